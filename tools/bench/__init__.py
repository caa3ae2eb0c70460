"""`kvbridge bench`: the suite and its paths (kvbridge against the raw library)."""
