"""specrt: speculative decoding deployed over ONNX step graphs and TensorRT engines."""

__version__ = "0.1.0"
