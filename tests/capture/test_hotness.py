"""Time shares from the profiled batched generation and num_tokens buckets."""

from __future__ import annotations

from prism_serve.capture import buckets_from_histogram
from prism_serve.capture.child import HOT_MAX_TOKENS, HOT_PROMPT_LENS


def test_buckets_from_histogram():
    assert buckets_from_histogram({1: 3, 5: 2, 8: 1, 122: 1}) == [1, 8, 128]
    assert buckets_from_histogram({}) == []


def test_time_shares_and_buckets(llama_capture):
    res = llama_capture
    # one batched prefill of mixed lengths, then decode steps of the whole batch
    assert len(res.num_tokens) >= 2 and max(res.num_tokens) > min(res.num_tokens)
    assert res.buckets == buckets_from_histogram(res.num_tokens)
    for r in res.regions:
        assert 0.0 < r.time_share <= 1.0, r.kind
        if r.dims:  # unsupported regions (rotary, attention) get their num_tokens buckets too
            assert r.buckets == res.buckets and r.rows_per_token == [1]
    # disjoint regions cannot take more than the whole forward
    disjoint = [r for r in res.regions if r.kind in ("rms_norm", "fused_add_rms_norm", "swiglu", "attention")]
    assert sum(r.time_share for r in disjoint) <= 1.0


def test_attention_shapes_follow_the_generation(llama_capture):
    """One batched prefill of every prompt, then one decode step of the whole batch per new token,
    each attending to one more cached position."""
    n, longest = len(HOT_PROMPT_LENS), max(HOT_PROMPT_LENS)
    want = [(n, longest, longest)] + [(n, 1, longest + i) for i in range(1, HOT_MAX_TOKENS)]
    got = [(s["batch"], s["q_len"], s["kv_len"]) for s in llama_capture.attention_shapes]
    assert sorted(got) == sorted(want) and all(s["count"] == 1 for s in llama_capture.attention_shapes)
    attn = next(r for r in llama_capture.regions if r.kind == "attention")
    assert attn.shapes == llama_capture.attention_shapes
    assert sum(s["count"] for s in attn.shapes) == sum(llama_capture.num_tokens.values())


def test_a_failure_inside_the_compiled_graph_is_reported_by_its_own_line_and_node():
    """torch.fx's interpreter re-raises an op's error with the node, the graph's traceback and a
    pointer to tlparse appended; the capture's one-line report used to keep only that pointer
    ("RuntimeError: Use tlparse to see full graph. ...")."""
    import pytest
    import torch
    import torch.fx as fx

    from prism_serve.capture.child import _one_line

    def broken(x):
        return x.reshape(-1, 7)

    gm = fx.symbolic_trace(broken)
    with pytest.raises(Exception) as info:
        fx.Interpreter(gm).run(torch.zeros(2, 3))
    line = _one_line(info.value)
    assert "tlparse" not in line and "shape '[-1, 7]' is invalid" in line and "while executing %reshape" in line
