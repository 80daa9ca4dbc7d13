"""Time shares from the profiled batched generation and num_tokens buckets."""

from __future__ import annotations

from prism_serve.capture import buckets_from_histogram


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
