"""specrt's version (what artifacts and manifests record)."""

__version__ = "0.1.0"
