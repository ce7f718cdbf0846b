"""specrt.calibration."""
