"""The serving tests' tritonserver files: the nvidia-pytriton wheel's tritonserver 2.51, installed into build/tritonserver
on first use; skipped, saying why, only where they cannot be installed (CI requires them: SPECRT_REQUIRE_TRITON=1)."""

import os

import pytest

from specrt.errors import SpecrtError
from tests.serving.triton_helpers import ROOT


@pytest.fixture(scope="module")
def files():
    from specrt.serving.tritonserver import locate

    try:
        return locate(ROOT / "build" / "tritonserver")
    except SpecrtError as e:
        if os.environ.get("SPECRT_REQUIRE_TRITON"):
            raise
        pytest.skip(f"no Triton server here: {e}")
