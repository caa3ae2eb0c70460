"""Device memory: copies between devices and the host, and push fences."""
