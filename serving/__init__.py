"""Deployment: triton.py writes a Triton Inference Server model repository for a bundle (`specrt triton`);
triton_model.py is its decode-loop model (a Triton Python-backend model; imported only inside Triton)."""
