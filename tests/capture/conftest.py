"""One vLLM capture run per model, shared by every test that needs it (each run is ~20 s)."""

from __future__ import annotations

import pytest

from prism_serve.capture import capture

from ..checkpoints import DTYPE, write_checkpoint


@pytest.fixture(scope="session")
def llama_capture():
    return capture("tiny-llama", DTYPE)


@pytest.fixture(scope="session")
def qwen3_capture():
    return capture("tiny-qwen3", DTYPE)


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("real-llama")
    return path, write_checkpoint("tiny-llama", path, embed_scale=1.0)


@pytest.fixture(scope="session")
def real_capture(real_checkpoint):
    return capture(real_checkpoint[0], DTYPE)


@pytest.fixture(scope="session")
def moe_capture(tmp_path_factory):
    """A mixture of experts (Qwen2-MoE's layout, 4 experts, top-2), captured in float32."""
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen2-moe"
    write_checkpoint("tiny-qwen2-moe", path)
    return capture(path, DTYPE)
