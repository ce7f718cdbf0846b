"""Engine builders (`specrt build`): static-shape engines of a bundle's models, recorded in engines.json.
graphs.py: the step module at static shapes, CUDA graphs on CUDA (TensorRT engines will join it here)."""
