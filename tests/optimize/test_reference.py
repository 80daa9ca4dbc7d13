"""The reference evaluator against plain torch formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.reference import (TOLERANCE, agreement_limit, as_torch_function, evaluate, expand_composites,
                                               max_rel_error, random_inputs)
from prism_serve.optimize.workloads.programs import WORKLOADS, EPS

TOKENS = (1, 5, 7)


def close(a, b, tol=1e-5):
    return ((a - b).abs().max() / b.abs().max()).item() < tol


def rms(x, w, eps=EPS):
    return F.rms_norm(x, (x.shape[-1],), weight=w, eps=eps)


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(d)) v


TORCH_FORMULAS = {
    "rms_norm": lambda x, w: [rms(x, w)],
    "fused_add_rms_norm": lambda x, r, w: [rms(x + r, w), x + r],
    "silu_and_mul": lambda g, u: [F.silu(g) * u],
    "rmsnorm_linear": lambda x, g, w: [rms(x, g) @ w.T],
    "swiglu": lambda x, wg, wu: [F.silu(x @ wg.T) * (x @ wu.T)],
    "rmsnorm_mlp": lambda x, g, wu, wg: [(rms(x, g) @ wu.T) * (rms(x, g) @ wg.T)],
    "gemma_rms_norm": lambda x, w: [rms(x, 1 + w)],
    "gemma_fused_add_rms_norm": lambda x, r, w: [rms(x + r, 1 + w), x + r],
    "gelu_tanh_and_mul": lambda g, u: [F.gelu(g, approximate="tanh") * u],
    "geglu": lambda x, wg, wu: [F.gelu(x @ wg.T, approximate="tanh") * (x @ wu.T)],
    "attention": lambda q, k, v: [attention(q, k, v)],
    "qk_norm_attention": lambda q, k, v, qw, kw: [attention(rms(q, qw), rms(k, kw), v)],
}
DIMS = {"rms_norm": dict(hidden=96), "fused_add_rms_norm": dict(hidden=96), "silu_and_mul": dict(intermediate=50),
        "rmsnorm_linear": dict(hidden=64, out=24), "swiglu": dict(hidden=48, intermediate=40),
        "rmsnorm_mlp": dict(hidden=48, intermediate=40),
        "gemma_rms_norm": dict(hidden=96), "gemma_fused_add_rms_norm": dict(hidden=96),
        "gelu_tanh_and_mul": dict(intermediate=50), "geglu": dict(hidden=48, intermediate=40),
        "attention": dict(batch=2, heads=4, q_len=3, kv_len=37, head_dim=16, kv_heads=2),
        "qk_norm_attention": dict(batch=2, heads=4, q_len=3, kv_len=37, head_dim=16, kv_heads=2)}


@pytest.mark.parametrize("name", sorted(TORCH_FORMULAS))
def test_reference_matches_torch(name):
    prog = WORKLOADS[name].program(**DIMS[name], dtype="float32")
    for n in TOKENS if WORKLOADS[name].default_num_tokens else (0,):
        inputs = random_inputs(prog, n)
        got = evaluate(prog, inputs)
        want = TORCH_FORMULAS[name](*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and close(g, w)
        eager = as_torch_function(prog)(*inputs)
        for e, w in zip(eager, want):
            assert close(e, w)


def test_gqa_packing_matches_torch_gqa():
    """Q packed as (batch, kv_heads, group * q_len, d) is torch's GQA with query head h on KV head h // group."""
    batch, heads, kv_heads, q_len, kv_len, d = 2, 6, 2, 3, 11, 8
    prog = WORKLOADS["attention"].program(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=d,
                                          kv_heads=kv_heads, dtype="float32")
    q = torch.randn(batch, heads, q_len, d)
    k, v = torch.randn(batch, kv_heads, kv_len, d), torch.randn(batch, kv_heads, kv_len, d)
    (out,) = evaluate(prog, [q.reshape(batch, kv_heads, -1, d), k, v])
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert close(out.reshape(batch, heads, q_len, d), want)


def test_expand_composites_leaves_only_primitives_and_the_same_function():
    prog = WORKLOADS["rmsnorm_mlp"].program(hidden=32, intermediate=16, dtype="float32")
    flat = expand_composites(prog)
    assert "rms_norm" not in {n.op for n in flat.nodes} and flat.outputs == prog.outputs
    inputs = random_inputs(prog, 5, seed=0)
    assert close(evaluate(flat, inputs)[0], evaluate(prog, inputs)[0], tol=1e-6)


def test_half_inputs_by_name_give_float32_results():
    prog = WORKLOADS["rms_norm"].program(hidden=64, dtype="float16")
    x, w = random_inputs(prog, 7, seed=1)
    assert x.dtype == torch.float16
    (y,) = evaluate(prog, {"w": w, "x": x})
    assert y.dtype == torch.float32 and close(y, rms(x.float(), w.float()))


def test_attention_subtracts_the_max():
    """Scores of ~1e4 overflow exp() unless the row max is subtracted first."""
    prog = WORKLOADS["attention"].program(batch=1, heads=1, q_len=1, kv_len=8, head_dim=4, dtype="float32")
    q = torch.full((1, 1, 1, 4), 100.0)
    k = torch.randn(1, 1, 8, 4) * 100
    v = torch.randn(1, 1, 8, 4)
    (out,) = evaluate(prog, [q, k, v])
    s = (q @ k.transpose(-1, -2)) / math.sqrt(4)
    want = torch.softmax(s - s.amax(-1, keepdim=True), -1) @ v
    assert torch.isfinite(out).all() and close(out, want)


def test_bad_inputs_are_clear_errors():
    prog = WORKLOADS["fused_add_rms_norm"].program(hidden=8, dtype="float32")
    x, r, w = random_inputs(prog, 3)
    with pytest.raises(ProgramError, match="expects 3 inputs"):
        evaluate(prog, [x, r])
    with pytest.raises(ProgramError, match="input 'w': expected shape"):
        evaluate(prog, [x, r, torch.ones(9)])
    with pytest.raises(ProgramError, match="num_tokens is 4 here but 3"):
        evaluate(prog, [x, torch.ones(4, 8), w])
    with pytest.raises(ProgramError, match="input 'x': expected rank 2"):
        evaluate(prog, [x.flatten(), r, w])
    with pytest.raises(ProgramError, match="inputs missing"):
        evaluate(prog, {"x": x})


def _roundings(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`exact` rounded to float16 towards -inf and towards +inf, elementwise: two faithful roundings."""
    near = exact.to(torch.float16)
    below = torch.where(near.double() > exact, torch.nextafter(near, torch.tensor(-math.inf, dtype=torch.float16)), near)
    above = torch.where(near.double() < exact, torch.nextafter(near, torch.tensor(math.inf, dtype=torch.float16)), near)
    return below, above


@pytest.mark.parametrize("scale", [1.0, 2e-6])
def test_two_roundings_of_one_answer_agree_within_the_limit_and_a_wrong_answer_does_not(scale):
    """Rounded down and rounded up to float16, one answer agrees with itself within
    `agreement_limit` at unit scale (the tolerance and one ulp) and at 2e-6 (subnormal, where one
    ulp is several times the tolerance); 1 % off it does not agree."""
    exact = torch.randn(16, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * scale
    limit = agreement_limit(exact, "float16")
    below, above = _roundings(exact)
    assert max_rel_error(below, above.double()) <= limit
    assert max_rel_error((exact * 1.01).to(torch.float16), above.double()) > limit
    if scale == 1.0:
        assert TOLERANCE["float16"] < limit < 1.5 * TOLERANCE["float16"]
    else:
        assert max_rel_error(below, above.double()) > TOLERANCE["float16"]  # the tolerance alone would fail it


def test_unseeded_inputs_leave_torchs_global_generator_alone():
    """An unseeded draw takes its seed from the OS: the caller's seeded stream goes on as it would."""
    from prism_serve.optimize.ir.reference import random_inputs

    prog = WORKLOADS["rms_norm"].program(hidden=64)
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    a, b = random_inputs(prog, 2), random_inputs(prog, 2)
    assert not torch.equal(a[0], b[0])  # fresh inputs each time
    assert torch.equal(torch.rand(3), want)
