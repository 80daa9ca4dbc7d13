"""A partial-rotary checkpoint in real vLLM (CPU build, Triton interpreter): a tiny GLM-4 (rotary on half
of each head, `partial_rotary_factor` 0.5, GPT-J's interleaved pairs), random weights, one vLLM process
running stock vLLM and vLLM with the plugin on oracle-seeded op and rotary kernels, eager and compiled:
greedy tokens identical, and `prism::rotary` ran in every layer (eager: the RotaryEmbedding replacement;
compiled: the fusion pass on vLLM's native rotary chain, the pass-through half concatenated back)."""

from __future__ import annotations

import pytest

from prism_serve.patch import seed
from prism_serve.patch.device import current_device

from ..checkpoints import config_of, write_checkpoint
from .conftest import fill
from .vllm_run import config, run_vllm

MODEL = "tiny-glm4"


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("glm4")
    write_checkpoint(MODEL, tmp / MODEL)
    progs = seed.model_programs(tmp / MODEL / "config.json", kinds=seed.OP_KINDS + (seed.ROTARY,))
    url = fill(tmp / "registry.db", seed.results(progs, current_device(use_vllm=False)[0], model=MODEL))
    return run_vllm(tmp / MODEL, tmp, [config("stock", url, "eager", "compiled", PRISM_SERVE_DISABLE="1"),
                                       config("rotary", url, "eager", "compiled")])


def test_the_seeded_rotary_program_is_glm4s_half_head_gptj_rotation():
    dims = seed.rotary_dims(config_of(MODEL))
    assert dims["rotary_dim"] == dims["head_dim"] // 2 and dims["neox"] == 0


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_partial_gptj_rotary_runs_in_every_layer_with_stock_tokens(glm4, mode):
    stock, run = glm4["stock"]["runs"][mode], glm4["rotary"]["runs"][mode]
    layers = config_of(MODEL)["num_hidden_layers"]
    forwards = run["kernel"]["silu_and_mul"] // layers
    assert run["tokens"] == stock["tokens"]
    assert run["kernel"]["rotary"] == layers * forwards > 0, run["kernel"]
    assert not any(run["fallback"].values()), run["fallback"]
    if mode == "compiled":
        assert run["compile"]["replaced"] == {"rotary": layers}
