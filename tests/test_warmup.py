"""`warmup` end to end on the embedded tiny Llama, as `prism-serve warmup` runs it (no --dtype: the
dtype vLLM serves the model in by default): real vLLM capture, search, checks against vLLM's own
outputs, the registry, the no-op second run, the rerun that reuses the stored designs, and vLLM
serving with the plugin on the kernels warmup stored (through the Triton interpreter, forced:
nothing is measured on a CPU). test_archs holds its float32 warmups to float32's precision."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from prism_serve.errors import PrismError
from prism_serve.optimize.generate.design import build
from prism_serve.optimize.workloads.programs import rmsnorm_linear, rotary
from prism_serve.registry import open_registry
from prism_serve.registry.store import list_kernels
from prism_serve.warmup import MAX_TOKENS, bucket_ranges, known_designs, model_fingerprint, warmup

from .checkpoints import WARMUP_BUDGET_S, WARMUP_WORK
from .cpu_gemm import packs_weights
from .patch.vllm_run import config, run_vllm

ROOT = Path(__file__).resolve().parents[1]
# what the plugin serves in the tiny Llama: each layer's two sides as regions, the final norm, and rotary
SERVED = {"rmsnorm_linear", "fused_add_rmsnorm_linear", "rmsnorm_swiglu", "fused_add_rms_norm", "rotary"}
# captured and supported, but run inside a served region (or, gate_up's norm, by no hook): not searched
INSIDE = {"rms_norm", "silu_and_mul", "swiglu", "fused_add_rmsnorm_linear"}
# vLLM's default dtype for the float32 tiny Llama (`vllm serve` with no --dtype), which warmup warms by default
SERVED_DTYPE = "bfloat16"
# four of its units in the last place: a kernel and vLLM each round the outputs, in their own order
BF16_ERROR = 2 ** -6


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """Three warmups of the embedded model in vLLM's default dtype, on one registry: the first
    searches, the second finds nothing new, the third (its capture deleted, the plugin forced on the
    warmed registry) captures again and reuses the stored designs."""
    tmp = tmp_path_factory.mktemp("warmup")
    url = f"sqlite:///{tmp / 'registry.db'}"
    old = os.environ.get("PRISM_SERVE_CACHE")
    os.environ["PRISM_SERVE_CACHE"] = str(tmp / "cache")
    saved = {k: os.environ.get(k) for k in ("PRISM_SERVE_REGISTRY", "PRISM_SERVE_FORCE")}
    try:
        stages = []
        first = warmup(None, registry=url, progress=lambda stage, done, total: stages.append(stage),
                       budget_s=WARMUP_BUDGET_S, work=WARMUP_WORK)
        second = warmup(None, registry=url, budget_s=WARMUP_BUDGET_S, work=WARMUP_WORK)
        # without the cached capture, with the plugin pointed at the warmed registry and forced on:
        # capture must still see vLLM's own ops, and every plan is reused instead of searched
        for f in (tmp / "cache" / "captures").glob("*.json"):
            f.unlink()
        os.environ.update(PRISM_SERVE_REGISTRY=url, PRISM_SERVE_FORCE="1")
        third = warmup(None, registry=url, budget_s=WARMUP_BUDGET_S, work=WARMUP_WORK)
    finally:
        for k, v in {"PRISM_SERVE_CACHE": old, **saved}.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return first, second, url, stages, third


def test_every_served_region_is_verified_against_vllm(warmed):
    first, _, _, stages, _ = warmed
    assert not first.nothing_new and stages[0] == "capture under vLLM" and stages[-1] == "done"
    assert first.dtype == SERVED_DTYPE
    done = [r for r in first.regions if r.status != "skipped"]
    assert {r.kind for r in done} == SERVED
    for r in done:
        assert r.status == "verified" and r.verified and r.design, r
        assert r.vllm_max_rel_error is not None and r.vllm_max_rel_error < BF16_ERROR
        # against vLLM's path for the region, per bucket; nothing is measured on a CPU
        assert len(r.modeled_speedup) == len(r.buckets) and r.measured_speedup == []
        assert r.buckets[-1][1] == MAX_TOKENS
    norm = next(r for r in done if r.kind == "fused_add_rms_norm")  # one vLLM kernel already
    assert all(0.8 <= x <= 1.25 for x in norm.modeled_speedup), norm.modeled_speedup
    skipped = {(r.kind, r.reason) for r in first.regions if r.status == "skipped"}
    not_searched = {kind for kind, why in skipped if why.startswith("not searched")}
    assert not_searched == INSIDE
    assert ("fused_add_rmsnorm_linear", "not searched: the plugin serves it inside rmsnorm_swiglu") in skipped
    unsupported = {kind for kind, why in skipped if not why.startswith("not searched")}
    assert unsupported == {"attention"}


def test_the_registry_holds_each_kernel_with_its_proof_design_and_checks(warmed):
    first, _, url, _, _ = warmed
    reg = open_registry(url)
    with reg.read() as s:
        kernels = list_kernels(s)
        assert {k.program.name for k in kernels} == SERVED and {k.dtype for k in kernels} == {SERVED_DTYPE}
        for k in kernels:
            assert k.status == "verified" and k.sgraph.proof["ok"] and "design" in k.sgraph.proof
            assert k.sgraph.tests["vllm_max_rel_error"] <= min(BF16_ERROR, k.sgraph.tests["vllm_error_limit"])
            # every bucket range's own kernel ran on vLLM's recorded forwards, those past the recorded
            # token counts too; the region's figure is the worst of them
            checks = k.sgraph.tests["vllm_checks"]
            assert f"{k.bucket_lo}-{k.bucket_hi}" in checks and k.sgraph.tests["vllm_checked_tokens"]
            assert k.sgraph.tests["vllm_max_rel_error"] in {c["max_rel_error"] for c in checks.values()}
            assert k.baseline_modeled_us > 0 and k.speedup is None  # vLLM's path modeled; nothing measured here
        reported = sorted(round(x, 9) for r in first.regions if r.status != "skipped" for x in r.modeled_speedup)
        assert sorted(round(k.modeled_speedup, 9) for k in kernels) == reported
        # shape-generic reuse: the stored rmsnorm_linear design builds for other dims of the family
        other = rmsnorm_linear(256, 384, "float32")  # and of another dtype
        designs = known_designs(s, other)
        assert designs and build(other, designs[0]).program == other
        # and the stored rotary design at twice the head dim, its halves' windows moved (`design.rebased`)
        wide = rotary(8, 4, 64, None, 4096, SERVED_DTYPE)
        designs = known_designs(s, wide)
        assert designs and build(wide, designs[0]).program == wide
    reg.close()
    n_regions = len([r for r in first.regions if r.status != "skipped"])
    assert len(kernels) == sum(len(r.buckets) for r in first.regions if r.status != "skipped") >= 2 * n_regions


def test_a_second_run_with_nothing_new_skips_vllm(warmed):
    _, second, _, _, _ = warmed
    assert second.nothing_new
    assert {r.kind for r in second.regions} == SERVED and all(r.status == "stored" for r in second.regions)


def test_a_rerun_reuses_the_stored_designs_and_capture_still_sees_vllm(warmed):
    first, _, _, _, third = warmed
    assert not third.nothing_new
    done = {r.kind: r for r in third.regions if r.status != "skipped"}
    assert set(done) == SERVED
    for r in done.values():
        assert r.reused and r.status == "verified" and r.vllm_max_rel_error < BF16_ERROR, r
    # per served kind (capture orders regions by measured time share, so two regions of one kind,
    # one of them skipped, may come in either order)
    assert {r.kind: r.design for r in first.regions if r.status != "skipped"} == {k: r.design for k, r in done.items()}


def test_a_capture_recorded_on_another_prompt_is_not_reused(monkeypatch):
    """The cached capture is keyed by what it depends on, the recorded prompt included: kernels
    stored after a capture that recorded another prompt are checked again on this one."""
    from prism_serve.capture import child
    from prism_serve.capture.embedded import resolve_model

    model = resolve_model(None)
    key = model_fingerprint(model, "auto")
    assert model_fingerprint(model, "auto") == key
    monkeypatch.setattr(child, "RECORD_PROMPT", child.RECORD_PROMPT[:7])
    assert model_fingerprint(model, "auto") != key


def test_bucket_ranges_are_disjoint_and_cover_everything():
    assert bucket_ranges([128, 8, 8]) == [(1, 8), (9, MAX_TOKENS)]
    assert bucket_ranges([1, 16, 256]) == [(1, 1), (2, 16), (17, MAX_TOKENS)]


def test_the_doctor_finds_every_stored_kind_serving_layers(warmed):
    from prism_serve.patch.doctor import patch_report

    _, _, url, _, _ = warmed
    report = patch_report("tiny-llama", url, force=True)  # vLLM's default dtype, as warmup's
    assert set(report["served"]) == SERVED and report["unserved"] == []
    assert report["served"]["rmsnorm_swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert report["served"]["fused_add_rms_norm"] == ["model.norm"]
    # the same from warmup's capture (how the doctor reports any architecture): the fusion pass's
    # matcher on vLLM's graph agrees with the layers config.json spells out
    capture = json.loads(next((Path(url.removeprefix("sqlite:///")).parent / "cache" / "captures").glob("*.json"))
                         .read_text())
    captured = patch_report("tiny-llama", url, force=True, capture=capture)
    assert captured["sites_from"].startswith("capture") and captured["dtype"] == report["dtype"]
    assert {k: len(v) for k, v in captured["served"].items()} == {k: len(v) for k, v in report["served"].items()}
    assert captured["unserved"] == [] and captured["served"]["fused_add_rms_norm"] == ["norm"]
    assert captured["served"]["rmsnorm_swiglu"] == [
        f"layers.{i}.post_attention_layernorm+layers.{i}.mlp.gate_up_proj+layers.{i}.mlp.act_fn" for i in (0, 1)]
    skipped = {row["op"]: row["why"] for row in captured["layers"] if not row["patched"]}
    assert set(skipped) == {"attention"} and "the IR has no masking" in skipped["attention"]


def test_a_warmup_that_fails_on_a_bad_model_leaves_no_registry_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[]")  # JSON, but not a model config
    registry = tmp_path / "new" / "registry.db"
    with pytest.raises(PrismError, match="must hold a JSON object"):
        warmup(model, registry=str(registry))
    assert not registry.exists() and not registry.parent.exists()


def test_vllm_serves_in_its_default_dtype_every_kernel_warmup_stored(warmed, tmp_path):
    """`prism-serve warmup` with no --dtype warms what `vllm serve` runs by default: vLLM's
    dtype="auto", which runs the float32 tiny Llama in bfloat16 (kernels for float32 would serve
    nothing there). vLLM then runs the stored kernels, in its default dtype, eager and compiled,
    its projections on its CPU GEMMs' packed weights where this CPU has one for bfloat16 (AMX, else
    oneDNN; else torch's linear on the plain weight), with stock vLLM's greedy tokens. (test_archs
    serves float32 warmups the same way.)"""
    first, _, url, _, _ = warmed
    stored = {r.kind for r in first.regions if r.status in ("verified", "enabled")}
    assert stored == SERVED
    model = ROOT / "prism_serve" / "capture" / "models" / "tiny-llama"
    modes = ("eager", "compiled")
    runs = run_vllm(model, tmp_path, [config("stock", url, *modes, dtype="auto", PRISM_SERVE_DISABLE="1"),
                                      config("prism", url, *modes, dtype="auto")])
    for mode in modes:
        prism = runs["prism"]["runs"][mode]
        assert all(prism["kernel"][k] > 0 for k in stored) and not any(prism["fallback"].values()), (mode, prism)
        # the ops inside the regions run in them, not as ops of their own
        assert prism["kernel"]["silu_and_mul"] == prism["kernel"]["swiglu"] == prism["kernel"]["rms_norm"] == 0
        # the plain weights of what vLLM packed, recorded for the kernels, wherever vLLM packs them
        assert bool(prism["compile"]["packed"]) == packs_weights(torch.bfloat16), mode
        assert prism["tokens"] == runs["stock"]["runs"][mode]["tokens"], mode
