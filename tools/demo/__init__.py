"""`kvbridge demo`: the demos of each connector, and the PD report they print."""
