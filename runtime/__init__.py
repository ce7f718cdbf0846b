"""specrt.runtime."""
