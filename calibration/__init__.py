"""Calibration: acceptance statistics (acceptance.json), the latency profile (latency.json), the cost model
of a decode round and the tuner that picks the speculation per batch size (plan.json)."""
