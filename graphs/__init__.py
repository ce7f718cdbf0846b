"""specrt.graphs."""
