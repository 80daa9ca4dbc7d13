"""Registries filled with real, proven oracle kernels for this device (the way warmup fills them)."""

from __future__ import annotations

import pytest

from prism_serve.capture.embedded import embedded_path
from prism_serve.patch import runtime, seed
from prism_serve.patch.device import current_device
from prism_serve.registry import add_kernel, open_registry

MODELS = ("tiny-llama", "tiny-qwen3")


def fill(path, results) -> str:
    url = f"sqlite:///{path}"
    reg = open_registry(url)
    with reg.write() as s:
        for r in results:
            add_kernel(s, r)
    reg.close()
    return url


@pytest.fixture(autouse=True)
def _runtime_closed():
    """A runtime a test opened (`ops.open_runtime`) is closed after it: the next test starts with none."""
    yield
    if (rt := runtime.current()) is not None:
        rt.close()


REGIONS = seed.OP_KINDS + seed.REGION_KINDS + ("swiglu",)


def model_results(status: str = "verified", kinds=seed.OP_KINDS, **kw):
    device = current_device(use_vllm=False)[0]
    out = []
    for m in MODELS:
        progs = seed.model_programs(embedded_path(m) / "config.json", kinds=kinds)
        out += seed.results(progs, device, status=status, model=m, **kw)
    return out


@pytest.fixture(scope="session")
def kernels_registry(tmp_path_factory):
    """Forced ('verified') kernels for both tiny models' ops on this device."""
    return fill(tmp_path_factory.mktemp("reg") / "registry.db", model_results())


@pytest.fixture(scope="session")
def regions_registry(tmp_path_factory):
    """As `kernels_registry`, plus every region kind the plugin serves in a decoder layer: the input
    side (rmsnorm_linear, fused_add_rmsnorm_linear), the post-attention side (rmsnorm_swiglu) and
    the SwiGLU MLP (which rmsnorm_swiglu takes in where both are stored)."""
    return fill(tmp_path_factory.mktemp("reg-regions") / "registry.db", model_results(kinds=REGIONS))


@pytest.fixture(scope="session")
def rotary_registry(tmp_path_factory):
    """As `kernels_registry`, plus both tiny models' rotary kernels and Qwen3's QK-norm + rotary."""
    return fill(tmp_path_factory.mktemp("reg-rotary") / "registry.db",
                model_results(kinds=seed.OP_KINDS + seed.ROTARY_KINDS))

