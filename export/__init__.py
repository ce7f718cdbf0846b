"""Export: a target + draft pair of local Hugging Face checkpoints into a bundle (step graphs, tokenizer,
checkpoint copies, manifest), atomically."""
