"""The captured set of Programs is exactly the expected one for both embedded configs."""

from __future__ import annotations

import json

from prism_serve.capture.embedded import embedded_path
from prism_serve.optimize.workloads import programs as P


def _config(name):
    return json.loads((embedded_path(name) / "config.json").read_text())


def _expected(cfg, qk_norm: bool) -> dict[str, tuple[str, list[int]]]:
    """canonical hash -> (kind, layers) of every supported region, built with the optimizer's builders."""
    h, inter, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg["rms_norm_eps"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layers = list(range(cfg["num_hidden_layers"]))
    want = {
        P.rms_norm(h, "float32", eps): [0],  # layer 0's input norm has no residual yet
        P.fused_add_rms_norm(h, "float32", eps): layers,
        P.rmsnorm_linear(h, (heads + 2 * kv) * hd, "float32", eps): [0],  # input_layernorm -> qkv_proj
        # later layers' input norms add the residual, as does every post_attention_layernorm (-> gate_up_proj)
        P.fused_add_rmsnorm_linear(h, (heads + 2 * kv) * hd, "float32", eps): layers[1:],
        P.fused_add_rmsnorm_linear(h, 2 * inter, "float32", eps): layers,
        P.swiglu(h, inter, "float32"): layers,
        P.rmsnorm_swiglu(h, inter, "float32", eps): layers,  # post_attention_layernorm -> gate_up -> SiluAndMul
        P.silu_and_mul(inter, "float32"): layers,
    }
    pos = cfg["max_position_embeddings"]
    want[P.rotary(heads, kv, hd, hd, pos, "float32")] = layers  # rotary_emb: NeoX, on the whole head
    if qk_norm:
        want[P.rms_norm(hd, "float32", eps)] = layers  # q_norm and k_norm, one row per (token, head)
        want[P.qk_norm_rotary(heads, kv, hd, hd, pos, eps, "float32")] = layers  # the norms, then rotary
    return {p.canonical_hash: (p.name, ls) for p, ls in want.items()}


def _got(result):
    return {r.program.canonical_hash: (r.kind, sorted(r.layers)) for r in result.regions if r.supported}


def test_llama_regions_are_exactly_the_expected_programs(llama_capture):
    assert _got(llama_capture) == _expected(_config("tiny-llama"), qk_norm=False)
    unsupported = {r.kind for r in llama_capture.regions if not r.supported}
    assert unsupported == {"attention"}


def test_qwen3_regions_include_qk_norm(qwen3_capture):
    assert _got(qwen3_capture) == _expected(_config("tiny-qwen3"), qk_norm=True)
    unsupported = {r.kind for r in qwen3_capture.regions if not r.supported}
    assert unsupported == {"attention"}
    qk = next(r for r in qwen3_capture.regions if r.kind == "rms_norm" and r.dims["hidden"] == 32)
    assert sorted(m.rsplit(".", 1)[-1] for m in qk.modules) == ["k_norm"] * 2 + ["q_norm"] * 2
    assert qk.dims == {"hidden": 32} and qk.rows_per_token == [2, 4]  # k heads, q heads
    # its Program's num_tokens counts rows (tokens * heads), so its buckets are its own
    seen = {n * r for n in qwen3_capture.num_tokens for r in (2, 4)}
    assert qk.buckets == sorted({1 << (n - 1).bit_length() for n in seen})


def test_dims_and_epsilon_are_the_models(qwen3_capture):
    cfg = _config("tiny-qwen3")
    by_kind = {}
    for r in qwen3_capture.regions:
        by_kind.setdefault(r.kind, []).append(r)
    for r in qwen3_capture.regions:
        if r.supported and r.eps is not None:
            assert r.eps == cfg["rms_norm_eps"]
        assert r.dtype == "float32"
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    (attn,) = by_kind["attention"]
    assert attn.dims == {"heads": heads, "kv_heads": kv, "head_dim": hd}
    assert attn.reason and attn.program is None and attn.buckets == qwen3_capture.buckets
    (rot,) = by_kind["rotary"]
    assert rot.dims == {"heads": heads, "kv_heads": kv, "head_dim": hd, "rotary_dim": hd,
                        "max_position": cfg["max_position_embeddings"], "neox": 1}
    assert sorted(rot.layers) == sorted(attn.layers) == list(range(cfg["num_hidden_layers"]))
    assert rot.reason is None and rot.program is not None and rot.buckets == qwen3_capture.buckets
    (qk,) = by_kind["qk_norm_rotary"]
    assert qk.dims == rot.dims and qk.eps == cfg["rms_norm_eps"] and sorted(qk.layers) == sorted(rot.layers)
    for kind in ("swiglu", "rmsnorm_swiglu"):
        assert by_kind[kind][0].dims == {"hidden": cfg["hidden_size"], "intermediate": cfg["intermediate_size"]}


def test_unsupported_regions_are_reported_with_a_reason_and_skipped(llama_capture):
    doc = llama_capture.to_json()
    skipped = [r for r in doc["regions"] if not r["supported"]]
    assert skipped and all(r["reason"] and r["program"] is None and r["program_hash"] is None for r in skipped)
    assert all("\n" not in r["reason"] for r in skipped)  # one line each
    json.dumps(doc)  # the report is plain JSON
