"""The runtime: Pipeline (the embedded API) runs methods (a Drafter + a Verifier) in the one Scheduler over
Backends (ONNX Runtime, PyTorch) through per-call Runners, with a runtime-owned KVCache. It reads what
calibration made only through the bundle's typed artifacts (specrt.bundle.artifacts)."""
