"""`specrt build`: the engines of both models of a bundle, by the backend BuildConfig names."""

from __future__ import annotations

from specrt.bundle.artifacts import EngineSet, TrtEngineSet
from specrt.engines.config import BuildConfig
from specrt.runtime.backends import backend_kind


def build(cfg: BuildConfig, progress: bool = True) -> EngineSet:
    """Build, check and record the engines of both models of cfg.bundle; returns the artifact written."""
    if backend_kind(cfg.backend).engines is TrtEngineSet:
        from specrt.engines.trt import build_trt

        return build_trt(cfg, progress)
    from specrt.engines.static import build_static

    return build_static(cfg, progress)
