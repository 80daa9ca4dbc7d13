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
