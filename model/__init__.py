"""The model layer: a Hugging Face Llama-family checkpoint loaded (checkpoint.py) and rewritten to the step
contract (step.py). Export traces it to ONNX; TorchBackend runs it as is."""
