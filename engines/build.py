"""`specrt build`: the engines of both models of a bundle, by the backend BuildConfig names."""

from __future__ import annotations

from specrt.bundle.artifacts import EngineSet
from specrt.engines.config import BuildConfig


def build(cfg: BuildConfig, progress: bool = True) -> EngineSet:
    """Build, check and record the engines of both models of cfg.bundle; returns the artifact written."""
    if cfg.backend == "trt":
        from specrt.engines.trt import build_trt

        return build_trt(cfg, progress)
    from specrt.engines.static import build_static

    return build_static(cfg, progress)
