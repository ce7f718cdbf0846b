"""specrt.bench."""
