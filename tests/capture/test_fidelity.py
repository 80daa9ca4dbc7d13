"""Each captured Program, evaluated on the layer's weights and an input recorded in vLLM,
reproduces that layer's output in vLLM (fp32, relative error < 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from prism_serve.capture.child import RECORD_PROMPT
from prism_serve.capture.embedded import embedded_path
from prism_serve.optimize.ir.reference import evaluate, max_rel_error

TOL = 1e-5


def _check_all(result):
    checked = 0
    for inst in result.instances:
        if not inst.supported:
            continue
        assert [n for n, _, _ in inst.recordings] == result.recorded_num_tokens
        for n, inputs, outputs in inst.recordings:
            assert inputs and outputs, f"{inst.kind} at {inst.modules}: nothing recorded"
            got = evaluate(inst.program, inputs)
            assert len(outputs) <= len(got)
            for g, want in zip(got, outputs):
                assert want.abs().max() > 0, f"{inst.kind} at {inst.modules}: recorded output is all zeros"
                err = max_rel_error(g, want.float())
                assert err < TOL, f"{inst.kind} at {inst.modules}, num_tokens {n}: rel err {err:.2e}"
        checked += 1
    return checked


def test_llama_fidelity(llama_capture):
    assert llama_capture.recorded_num_tokens == [len(RECORD_PROMPT), 1]  # the prefill and one decode step
    assert _check_all(llama_capture) == 17  # 8 per layer (rotary among them) + the final norm


def test_qwen3_fidelity(qwen3_capture):
    assert _check_all(qwen3_capture) == 23  # + q_norm, k_norm and QK-norm + rotary per layer


def test_the_comparison_is_sharp(llama_capture):
    """Negative control: a slightly wrong epsilon or weight is caught."""
    inst = next(i for i in llama_capture.instances if i.kind == "rmsnorm_linear")
    from prism_serve.optimize.workloads.programs import rmsnorm_linear

    wrong_eps = rmsnorm_linear(inst.dims["hidden"], inst.dims["out"], "float32", 1e-2)
    assert max_rel_error(evaluate(wrong_eps, inst.inputs)[0], inst.outputs[0]) > TOL
    inputs = list(inst.inputs)
    inputs[2] = inputs[2] * (1 + 1e-3 * torch.randn_like(inputs[2]))
    assert max_rel_error(evaluate(inst.program, inputs)[0], inst.outputs[0]) > TOL


# The attention-side regions have no Program (the IR cannot express them), but what capture
# reports about them is checked all the same: the recorded vLLM op, re-done in plain torch from
# the reported dims and the model's config, gives vLLM's output.


def _rope(x: torch.Tensor, positions: torch.Tensor, heads: int, head_dim: int, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of (tokens, heads * head_dim), from rope_theta (not vLLM's cache)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.double()[:, None] * inv_freq
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double().reshape(len(x), heads, head_dim)
    a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).reshape(len(x), -1).float()


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_rotary_regions_match_a_torch_rope(which, request):
    res = request.getfixturevalue(f"{which}_capture")
    cfg = json.loads((embedded_path(f"tiny-{which}") / "config.json").read_text())
    sites = [i for i in res.instances if i.kind == "rotary"]
    assert len(sites) == cfg["num_hidden_layers"]
    positions_seen = []
    for inst in sites:
        d = inst.dims
        assert d["neox"] == 1 and d["rotary_dim"] == d["head_dim"]
        for _, (q, k, positions, _cache), (q_out, k_out) in inst.recordings:  # the rotary Program's inputs
            positions = positions.reshape(-1)
            positions_seen.append(positions.tolist())
            for x, out, heads in ((q, q_out, d["heads"]), (k, k_out, d["kv_heads"])):
                assert x.shape == out.shape == (len(positions), heads, d["head_dim"])
                want = _rope(x.reshape(len(x), -1), positions, heads, d["head_dim"], cfg["rope_theta"])
                assert max_rel_error(want, out.reshape(len(out), -1)) < TOL
            assert max_rel_error(q, q_out) > TOL or positions.max() == 0  # the op really rotated
    n = len(RECORD_PROMPT)
    assert positions_seen[:2] == [list(range(n)), [n]]  # the recorded prefill, then its decode step


def _sdpa(q, k, v, causal: bool) -> torch.Tensor:
    """(tokens, heads, head_dim) attention with GQA, scale 1/sqrt(head_dim)."""
    t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                                            enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_attention_regions_match_torch_sdpa(which, request):
    """The prefill is causal attention of the 40-token prompt; its decode step attends to the
    prompt's cached keys and values (recorded in the prefill) plus its own."""
    res = request.getfixturevalue(f"{which}_capture")
    sites = [i for i in res.instances if i.kind == "attention"]
    assert sites
    for inst in sites:
        (n0, (q0, k0, v0), (o0,)), (n1, (q1, k1, v1), (o1,)) = inst.recordings
        d = inst.dims
        assert (n0, n1) == (len(RECORD_PROMPT), 1) and q0.shape[1:] == (d["heads"], d["head_dim"])
        assert k0.shape[1:] == v0.shape[1:] == (d["kv_heads"], d["head_dim"])
        assert max_rel_error(_sdpa(q0, k0, v0, causal=True), o0) < TOL
        assert max_rel_error(_sdpa(q1, torch.cat([k0, k1]), torch.cat([v0, v1]), causal=False), o1) < TOL


def test_a_mixture_of_experts_fidelity(moe_capture):
    """Every region of an MoE model, its routed experts among them: the experts Program on the
    recorded routing, hidden states and the plain stacked weights the capture child kept gives what
    vLLM's CPU fused MoE wrote (on the weights it packed), in every layer, prefill and decode."""
    experts = [i for i in moe_capture.instances if i.program is not None and i.program.name.startswith("moe_experts")]
    assert experts and all(i.supported for i in experts)
    # per layer: its two norms (as ops), the input norm + qkv, rotary and the experts; the final norm
    assert _check_all(moe_capture) == 11
    for inst in experts:
        for _, (x, ids, weights, w13, w2), _ in inst.recordings:
            assert ids.dtype == torch.int32 and ids.shape == (x.shape[0], inst.dims["top_k"])
            # the top-2 of 4 softmax weights, not renormalized (the config's norm_topk_prob is false)
            assert ((weights.sum(1) > 0.5) & (weights.sum(1) < 1 - 1e-6)).all()


def test_the_experts_comparison_is_sharp(moe_capture):
    """Negative controls on vLLM's own output: a token routed to expert e + 1, and the gate and up
    halves of w13 swapped, are each caught."""
    inst = next(i for i in moe_capture.instances if i.program is not None and i.program.name.startswith("moe_experts"))
    x, ids, weights, w13, w2 = inst.inputs
    (want,) = inst.outputs
    shifted = (ids + 1) % inst.dims["num_experts"]
    assert max_rel_error(evaluate(inst.program, [x, shifted, weights, w13, w2])[0], want) > 1e-2
    assert max_rel_error(evaluate(inst.program, [x, ids, weights, w13.flip(1), w2])[0], want) > 1e-2
