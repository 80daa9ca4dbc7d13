"""Every hand-built sGraph, generated to Triton and run through the interpreter, matches its Program."""

import pytest

from prism_serve.optimize.ir.schema import sgraph_from_json
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import ORACLES, default_assignment, oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

from .kernel_check import check_instance

H100 = get_gpu("h100")

# (workload, dims, num_tokens per case): non-power-of-two hidden sizes and a single token included.
TOKEN_CASES = [
    ("rms_norm", {"hidden": 100}, (1, 7, 33)),
    ("rms_norm", {"hidden": 256}, (1, 16)),
    ("fused_add_rms_norm", {"hidden": 100}, (1, 7, 33)),
    ("fused_add_rms_norm", {"hidden": 64}, (3,)),
    ("silu_and_mul", {"intermediate": 96}, (1, 7, 33)),
    ("silu_and_mul", {"intermediate": 50}, (2,)),
    ("rmsnorm_linear", {"hidden": 96, "out": 48}, (1, 7, 20)),
    ("rmsnorm_linear", {"hidden": 64, "out": 40}, (5,)),
    ("fused_add_rmsnorm_linear", {"hidden": 96, "out": 48}, (1, 7, 20)),
    ("fused_add_rmsnorm_linear", {"hidden": 64, "out": 40}, (5,)),
    ("rmsnorm_linear_bias", {"hidden": 96, "out": 48}, (1, 7, 20)),
    ("fused_add_rmsnorm_linear_bias", {"hidden": 64, "out": 40}, (1, 5)),
    ("swiglu", {"hidden": 64, "intermediate": 96}, (1, 7, 20)),
    ("swiglu", {"hidden": 48, "intermediate": 32}, (3,)),
    ("rmsnorm_mlp", {"hidden": 64, "intermediate": 32}, (1, 7, 20)),
    ("rmsnorm_mlp", {"hidden": 80, "intermediate": 48}, (2,)),
    ("rmsnorm_swiglu", {"hidden": 64, "intermediate": 32}, (1, 7, 20)),
    ("rmsnorm_swiglu", {"hidden": 80, "intermediate": 48}, (2,)),
    ("rmsnorm_geglu", {"hidden": 80, "intermediate": 48}, (1, 7)),
    ("gemma_rms_norm", {"hidden": 100}, (1, 7, 33)),
    ("gemma_fused_add_rms_norm", {"hidden": 100}, (1, 7, 33)),
    ("gelu_tanh_and_mul", {"intermediate": 50}, (1, 7, 33)),
    ("geglu", {"hidden": 48, "intermediate": 40}, (1, 7, 20)),
    ("gemma_rmsnorm_linear", {"hidden": 96, "out": 40}, (1, 7, 20)),
    ("gemma_fused_add_rmsnorm_linear", {"hidden": 64, "out": 40}, (1, 5)),
    ("gemma_rmsnorm_geglu", {"hidden": 80, "intermediate": 48}, (1, 7)),
]
ATTENTION_CASES = [  # (batch, heads, q_len, kv_len, head_dim, kv_heads), KV splits
    ((2, 8, 1, 96, 32, 4), 4),
    ((1, 4, 3, 50, 16, 2), 2),
    ((1, 2, 1, 64, 24, 2), 2),
]


def _instance(name, dims, dtype, **kw):
    prog = WORKLOADS[name].program(**dims, dtype=dtype)
    g = oracle(prog)
    return instantiate(g, default_assignment(g, target_tile=16, **kw), H100)


@pytest.mark.parametrize("name,dims,tokens", TOKEN_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_token_oracles_match_reference(name, dims, tokens, dtype):
    inst = _instance(name, dims, dtype)
    for n in tokens:
        check_instance(inst, n, dtype)


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rmsnorm_linear",
                                  "gemma_rms_norm", "gemma_fused_add_rms_norm", "gelu_tanh_and_mul", "geglu"])
def test_bf16_within_rounding(name):
    dims = dict(TOKEN_CASES[[c[0] for c in TOKEN_CASES].index(name)][1])
    check_instance(_instance(name, dims, "bfloat16"), 5, "bfloat16")


@pytest.mark.parametrize("dims", [{"num_experts": 5, "top_k": 2, "hidden": 48, "intermediate": 40},
                                  {"num_experts": 3, "top_k": 3, "hidden": 32, "intermediate": 24}], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["moe_experts", "moe_experts_gelu_tanh"])
def test_the_experts_two_kernel_oracle_matches_reference(name, dims, dtype):
    """h per (token, choice) over a loop of hidden, then the weighted w2 products per (token, hidden
    block) over a loop of the choices (a token choosing every expert in the second case)."""
    inst = _instance(name, dims, dtype, block_tokens=1)
    assert [k.forloop for k in inst.sgraph.kernels] == ["F", "FK"]
    for n in (1, 7):
        check_instance(inst, n, dtype)


@pytest.mark.parametrize("case,splits", ATTENTION_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["attention", "qk_norm_attention"])
def test_split_kv_attention_matches_reference(name, case, splits, dtype):
    b, h, q, kv, hd, hk = case
    inst = _instance(name, dict(batch=b, heads=h, q_len=q, kv_len=kv, head_dim=hd, kv_heads=hk),
                     dtype, kv_splits=splits)
    check_instance(inst, 0, dtype)


def test_split_kv_loop_with_several_steps():
    """The online-softmax rescale is exercised only when the loop runs more than once."""
    prog = WORKLOADS["attention"].program(batch=1, heads=2, q_len=1, kv_len=128, head_dim=16, kv_heads=2,
                                          dtype="float32")
    g = oracle(prog)
    inst = instantiate(g, {"B": 1, "H": 2, "S": 2, "F": 4}, H100)
    check_instance(inst, 0, "float32")


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_oracle_json_round_trip(name):
    dims = dict(kv_len=64, head_dim=32) if "attention" in name else {}
    g = oracle(WORKLOADS[name].program(**dims))
    again = sgraph_from_json(g.to_json())
    assert again == g
    assert again.to_json() == g.to_json()
