"""Engine builders (`specrt build`): config.py (what to build), build.py (the dispatch), static.py (the step
module at static shapes, CUDA graphs on CUDA -> engines.json), trt.py (TensorRT plans of the step ONNX ->
trt-engines.json)."""
