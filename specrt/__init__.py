"""specrt: speculative decoding deployed over ONNX step graphs and TensorRT engines.

    from specrt import Pipeline
    pipe = Pipeline.load("build/demo")
"""

from specrt.version import __version__

__all__ = ["Pipeline", "Generation", "__version__"]


def __getattr__(name: str):
    # imported on first use, so that `import specrt` (and the CLI's startup) stays light
    if name in ("Pipeline", "Generation"):
        from specrt.runtime import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'specrt' has no attribute {name!r}")
