"""Decoder architectures beyond Llama and Qwen3, end to end on tiny random-weight checkpoints:
`warmup` (capture under vLLM, search, check against vLLM, store), then one vLLM process per
architecture running stock vLLM and vLLM with the plugin on the warmed registry, eager and
compiled, both in the dtype the tests run the checkpoint in (`dtype_of`): greedy tokens must be identical, and every region kind that capture reported and
warmup stored must have run as a prism kernel in compiled mode, except the (architecture, kind)
pairs of `NOT_SERVED`, each with the reason, which are checked to still be unserved (so the
list shrinks when serving closes a gap).

CI runs `CI_ARCHS` only (each architecture costs a capture, a warmup and a vLLM process: 3 to
10 minutes on two shared cores): Qwen2-MoE without its shared expert, which has Qwen2's qkv bias and
a mixture of experts in one model (it replaced tiny-qwen2 and tiny-mixtral in CI on 2026-12-07, to
keep CI under its time limit). PRISM_SERVE_TEST_ARCHS=all (or a comma-separated list) runs the
others. In a mixture of experts (tiny-qwen2-moe, tiny-mixtral, tiny-qwen3-moe) the router stays
vLLM's, the routed experts run `prism::moe_experts` (captured, searched, verified and stored by warmup;
served at decode sizes, `DECODE`) in both modes, and the input norm + qkv and the residual add + norm before the experts are served
(in compiled mode; in eager mode only the norm, as an op). Seen on 2026-12-03 (tokens identical everywhere): Mistral and Phi-3 (vLLM builds Phi-3 as a
Llama) serve every stored kind; since the compiled-mode pattern pass (fusion.py) Qwen2 and
Granite serve every stored kind too (Granite's rmsnorm_linear and rmsnorm_swiglu checked on
2026-12-03; Qwen2's input norm + biased qkv as the `_bias` kinds since 2026-12-04). OLMo 2 runs
through vLLM's Transformers backend, whose SiLU*mul is the SiluAndMul vLLM built once and kept:
this process's stock config had built it, so the plugin's replacement got no call
(`hooks._forget_built_activations` now drops it). Its run then passed the child's 1200 s limit: the
stored silu_and_mul kernel, tuned at 8 tokens, had 1 x 1 tiles and ran vLLM's profile pass as
millions of interpreted blocks (the last bucket now takes the near tie that scales,
`tune.rank_open`). Since 2026-12-04 its run takes under two minutes and it stores swiglu: its MLP's
module paths, named through the bound forward (`mlp.forward.__self__.gate_up_proj`), are read in
their roles, and the pass matches its SiLU*mul on the [1, tokens, 2d] output the backend keeps
(`patterns.ACT_RANKS`). Compiled mode runs swiglu (14 calls in 7 forwards, no fallback), eager mode
no MLP region (no class hook holds its MLP), tokens identical. Its norms (the backend's TPAwareRMSNorm,
post-attention, post-feedforward, q/k over all heads, final) are found by their op since 2026-12-04
and served as rms_norm in both modes (63 calls in 7 compiled forwards, 9 per forward).
Gemma and Gemma 2
(PRISM_SERVE_TEST_ARCHS=tiny-gemma,tiny-gemma2, 4 min for both on two shared cores) store
rmsnorm_linear and fused_add_rmsnorm_linear (the input norm + qkv, on the weight w + 1 that vLLM
computes; fp32 only), rmsnorm_geglu (the norm before the MLP + gate_up + tanh GELU*mul, one kernel
since 2026-12-04, where geglu and a Gemma norm ran before), gemma_fused_add_rms_norm (the final
norm) and, Gemma 2 only, gemma_rms_norm (its post-attention and post-feedforward norms), and serve
every one of them in compiled mode with no fallback (2026-12-04, 7 forwards: rmsnorm_geglu 14 calls
in each, gemma_rms_norm 28 in Gemma 2); in eager mode their tanh-GELU*mul runs as prism's op (12 calls in 6 forwards, since 2026-12-05: Gemma caches the activation it builds, which `hooks._forget_built_activations` clears), the norms and regions stay vLLM's. Gemma in float16 (tiny-gemma-fp16, run in
its own dtype: its norm weight w + 1 is float32, so the plain kinds cannot take it) stores and serves
the `gemma_` kinds in compiled mode (2026-12-04, 7 forwards: gemma_rmsnorm_linear 7,
gemma_fused_add_rmsnorm_linear 7, gemma_rmsnorm_geglu 14, gemma_fused_add_rms_norm 7 calls, no
fallback, tokens identical; the search's fp16 outlier check refused two designs that overflow). The tiny Gemma checkpoints repeat one
token per prompt (the cause is not investigated), so their token check is weaker than the
others': warmup's check against vLLM's own outputs on the layers' real inputs is the stronger one.
"""

from __future__ import annotations

import json
import os

import pytest

from prism_serve.capture.embedded import resolve_model
from prism_serve.patch import seed
from prism_serve.patch.device import current_device
from prism_serve.registry import add_kernel, open_registry
from prism_serve.registry.store import list_kernels, remove_kernels
from prism_serve.warmup import model_fingerprint, warmup

from ..checkpoints import ARCH_CONFIGS, WARMUP_BUDGET_S, WARMUP_WORK, config_of, dtype_of, write_checkpoint
from .vllm_child import MAX_TOKENS
from .vllm_run import config, run_vllm

ARCHS = tuple(ARCH_CONFIGS)
CI_ARCHS = ("tiny-qwen2-moe",)
MODES = ("eager", "compiled")
# region kinds warmup stores for an architecture that the plugin does not serve yet, and why
NOT_SERVED: dict[tuple[str, str], str] = {}
# the token bucket the vLLM runs serve the experts at: decode steps (they decode 1 to 3 sequences)
DECODE = (1, 8)
# the search work of an architecture's warmup where the tests' default is not enough: tiny Mixtral's
# experts (intermediate 256, the tiny Qwen MoEs' is 96) get one design that fits at 500,000 steps
# and two at 600,000 (2026-12-08)
ARCH_WORK = {"tiny-mixtral": 2 * WARMUP_WORK}
# the kinds of an MLP's activation, with or without its projection and norm
MLP_KINDS = {"silu_and_mul", "swiglu", "rmsnorm_swiglu", "gelu_tanh_and_mul", "geglu", "rmsnorm_geglu"}
# the module fixture runs a warmup (a capture, a search when the registry has no plan yet) and a
# vLLM process with four engines: minutes on two busy cores
pytestmark = pytest.mark.timeout(1800)


def _selected() -> tuple[str, ...]:
    want = os.environ.get("PRISM_SERVE_TEST_ARCHS", "").strip()
    if want == "all":
        return ARCHS
    return tuple(a for a in (want.split(",") if want else CI_ARCHS) if a)


@pytest.fixture(scope="session")
def arch_registry(tmp_path_factory):
    """One registry for every architecture's warmup: same-shaped Programs reuse the stored plans."""
    return f"sqlite:///{tmp_path_factory.mktemp('arch-registry') / 'registry.db'}"


@pytest.fixture(scope="module", params=_selected())
def arch(request, arch_registry, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    path = tmp / name
    biases = [k for k in write_checkpoint(name, path) if k.endswith(".bias")]
    old = os.environ.get("PRISM_SERVE_CACHE")
    os.environ["PRISM_SERVE_CACHE"] = str(tmp / "cache")
    try:
        report = warmup(path, registry=arch_registry, dtype=dtype_of(name), budget_s=WARMUP_BUDGET_S,
                        work=ARCH_WORK.get(name, WARMUP_WORK))
        key = model_fingerprint(resolve_model(path), dtype_of(name))
        capture = json.loads((tmp / "cache" / "captures" / f"{key}.json").read_text())
    finally:
        if old is None:
            os.environ.pop("PRISM_SERVE_CACHE", None)
        else:
            os.environ["PRISM_SERVE_CACHE"] = old
    _seed_unwarmed(path, arch_registry, report, name)
    _experts_at_decode_only(arch_registry)
    runs = run_vllm(path, tmp, [config("stock", arch_registry, *MODES, dtype=dtype_of(name), PRISM_SERVE_DISABLE="1"),
                                config("prism", arch_registry, *MODES, dtype=dtype_of(name))])
    return {"name": name, "path": path, "registry": arch_registry, "biases": biases, "report": report,
            "capture": capture, "runs": runs}


def _seed_unwarmed(path, url: str, report, name: str) -> None:
    """The rotary kinds warmup's search did not store within the tests' budget, from their proven,
    numerically checked oracles (as `seed` fills the other tests' registries), so the vLLM runs
    serve rotary whatever the search reached."""
    stored = {r.kind for r in report.regions if r.status in ("verified", "enabled")}
    progs = seed.model_programs(path / "config.json", dtype=dtype_of(name),
                                kinds=tuple(k for k in seed.ROTARY_KINDS if k not in stored))
    reg = open_registry(url)
    try:
        with reg.write() as s:
            progs = [p for p in progs if not list_kernels(s, program=p.canonical_hash)]
            device = current_device(use_vllm=False)[0]
            for p in progs:
                for r in seed.results([p], device, model=name):
                    add_kernel(s, r)
    finally:
        reg.close()


def _experts_at_decode_only(url: str) -> None:
    """Warmup stores the routed experts for every bucket; the vLLM runs serve them at decode sizes only
    (`DECODE`), as `prism-serve registry rm` of the others would: above it the design is modeled
    slower than vLLM's fused MoE, and interpreted, vLLM's prefills and profile pass through it took
    the two vLLM runs 89 s instead of 39 s. Prefills run vLLM's fused MoE."""
    reg = open_registry(url)
    try:
        with reg.write() as s:
            remove_kernels(s, [k.id for kind in seed.MOE_KINDS for k in list_kernels(s, program=kind)
                               if (k.bucket_lo, k.bucket_hi) != DECODE])
    finally:
        reg.close()


def _stored(arch) -> set[str]:
    return {r.kind for r in arch["report"].regions if r.status in ("verified", "enabled")}


def test_warmup_stores_what_capture_reports_and_fails_no_region(arch):
    report, capture = arch["report"], arch["capture"]
    failed = [(r.kind, r.reason) for r in report.regions if r.status == "failed"]
    assert not failed, failed
    supported = {r["kind"] for r in capture["regions"] if r["supported"]}
    assert _stored(arch) <= supported
    # every region capture found is in the report: stored, or skipped with its reason
    assert {r["kind"] for r in capture["regions"]} == {r.kind for r in report.regions}
    assert all(r.reason for r in report.regions if r.status == "skipped")
    # a float32 model's stored kernels agree with vLLM's outputs to float32's precision (test_warmup's
    # warmups are bfloat16's, vLLM's default)
    if dtype_of(arch["name"]) == "float32":
        stored = [r for r in report.regions if r.status in ("verified", "enabled")]
        assert stored and all(r.vllm_max_rel_error < 1e-4 for r in stored), [(r.kind, r.vllm_max_rel_error) for r in stored]


@pytest.mark.parametrize("mode", MODES)
def test_same_greedy_tokens_with_the_plugin(arch, mode):
    stock, prism = arch["runs"]["stock"], arch["runs"]["prism"]
    assert prism["runs"][mode]["tokens"] == stock["runs"][mode]["tokens"]
    assert not any(stock["runs"][mode]["kernel"].values())
    fell_back = {k: n for k, n in prism["runs"][mode]["fallback"].items() if n and k not in seed.MOE_KINDS}
    assert not fell_back, fell_back  # the experts' prefills run vLLM's fused MoE (`DECODE`)


def _doctor(arch) -> dict:
    from prism_serve.patch.doctor import patch_report

    if "doctor" not in arch:
        arch["doctor"] = patch_report(arch["path"], arch["registry"], force=True, capture=arch["capture"])
    return arch["doctor"]


def test_every_stored_region_kind_is_served_in_compiled_mode(arch):
    """Every region capture reports is served in compiled mode, by its own kernel or inside a larger
    region's; the kinds whose own kernel runs are the ones the doctor names, and they ran. (Warmup
    also stores what only eager mode runs on its own: Qwen2's swiglu, whose decoder layer no eager
    hook patches, runs inside rmsnorm_swiglu in compiled mode.)"""
    ran = arch["runs"]["prism"]["runs"]["compiled"]["kernel"]
    stored, r = _stored(arch), _doctor(arch)
    served = {k for k in stored if ran.get(k, 0) > 0}
    expected = {k for k in stored if r["served"].get(k) and (arch["name"], k) not in NOT_SERVED}
    assert served == expected, {"stored": sorted(stored), "ran": ran, "doctor": r["served"]}
    assert all(row["patched"] for row in r["layers"] if row["op"] in stored), [
        row for row in r["layers"] if row["op"] in stored and not row["patched"]]


@pytest.mark.parametrize("mode", MODES)
def test_rotary_runs_as_a_prism_kernel_in_every_layer(arch, mode):
    """Capture reports each layer's rotary (QK-norm + rotary where q and k are normed per head); the
    plugin serves it in every layer: eager mode through the RotaryEmbedding replacement, compiled mode
    through the fusion pass on vLLM's native rotary chain."""
    layers = config_of(arch["name"])["num_hidden_layers"]
    captured = [r for r in arch["capture"]["regions"] if r["kind"] == "rotary"]
    assert captured and all(r["supported"] for r in captured) and sum(len(r["modules"]) for r in captured) == layers
    ran = arch["runs"]["prism"]["runs"][mode]["kernel"]
    rotated = ran["rotary"] + ran["qk_norm_rotary"]
    assert rotated > 0 and rotated % layers == 0, ran
    if mode == "compiled":
        replaced = arch["runs"]["prism"]["runs"][mode]["compile"]["replaced"]
        assert replaced.get("rotary", 0) + replaced.get("qk_norm_rotary", 0) == layers, replaced


def test_a_projection_bias_gives_the_bias_kinds_and_nothing_else_does(arch):
    """Qwen2-style qkv bias: capture reports the input norm + qkv projection as the `_bias` kinds,
    whose Programs add the bias (it was once folded into the weight, which failed warmup's check,
    then reported unsupported); warmup stores them and compiled mode serves them (the test above)."""
    kinds = {m.split("+")[-1].rsplit(".", 1)[-1]: r["kind"] for r in arch["capture"]["regions"]
             for m in r["modules"] if r["kind"].endswith("_bias")}
    assert not [r for r in arch["capture"]["regions"] if "bias" in (r["reason"] or "")]
    if arch["biases"]:
        assert set(kinds) == {"qkv_proj"}
        assert {r["kind"] for r in arch["capture"]["regions"] if r["kind"].endswith("_bias")} == {
            "rmsnorm_linear_bias", "fused_add_rmsnorm_linear_bias"}
        assert {"rmsnorm_linear_bias", "fused_add_rmsnorm_linear_bias"} <= _stored(arch)
    else:
        assert not kinds


@pytest.mark.parametrize("mode", MODES)
def test_a_mixture_of_experts_runs_its_experts_as_prism_kernels_in_every_layer(arch, mode):
    """The routed experts (captured, searched, verified and stored by warmup: the two-kernel design)
    run `prism::moe_experts` in every MoE layer of every decode step, in eager and compiled mode alike (vLLM's CPU experts class is patched;
    the tokens and the absence of any fallback are checked above); no dense-MLP region spans the
    router and the experts, and the regions around them are served in compiled mode."""
    if seed.moe_dims(config_of(arch["name"])) is None:
        pytest.skip("not a mixture of experts")
    layers = config_of(arch["name"])["num_hidden_layers"]
    # capture records every layer's experts, with the config's dims; warmup stored the searched design
    (experts,) = [r for r in arch["capture"]["regions"] if r["kind"] in seed.MOE_KINDS]
    assert len(experts["modules"]) == layers and experts["dims"] == seed.moe_dims(config_of(arch["name"]))
    assert experts["supported"] and experts["program_hash"]
    (searched,) = [r for r in arch["report"].regions if r.kind == experts["kind"]]
    assert searched.status in ("verified", "enabled") and searched.design.count("block ") == 2, searched
    ran, missed = arch["runs"]["prism"]["runs"][mode]["kernel"], arch["runs"]["prism"]["runs"][mode]["fallback"]
    # every decode step after the prefill, in every layer; the prefills (and vLLM's profile pass) missed
    assert ran["moe_experts"] >= layers * (MAX_TOKENS - 1) and ran["moe_experts"] % layers == 0, ran
    assert missed["moe_experts"] > 0 and missed["moe_experts"] % layers == 0, missed
    stored = _stored(arch)
    assert not stored & MLP_KINDS
    if mode == "compiled":
        bias = "_bias" if arch["biases"] else ""  # Qwen2-MoE's qkv bias: the input side is the `_bias` kinds
        around = {f"rmsnorm_linear{bias}", f"fused_add_rmsnorm_linear{bias}", "fused_add_rms_norm"}
        assert around <= stored
        assert all(ran[k] > 0 for k in around) and not any(ran.get(k, 0) for k in MLP_KINDS), ran


def test_the_doctor_names_the_layers_each_stored_kind_serves(arch):
    """From the architecture's capture (the fusion pass's matcher on vLLM's graph), whatever its
    classes: every kind warmup stored serves layers (in one mode at least) or its layers run on
    another kind's kernel (a float32 Gemma norm on a plain norm kernel the shared registry holds for
    the key), and nothing vLLM runs is left unexplained."""
    r = _doctor(arch)
    assert r["sites_from"].startswith("capture") and r["plugin"] == "would patch"
    stored = _stored(arch)
    # the rows of each kind that run on their own, not inside a larger region's kernel
    alone = {k: [row for row in r["layers"] if row["op"] == k and "inside" not in row] for k in stored}
    elsewhere = {k for k in stored if alone[k] and all(row["patched"] and row.get("kernel") not in (None, k)
                                                       for row in alone[k])}
    assert stored <= set(r["served"]) and all(r["served"][k] or r["served_eager"][k] for k in stored - elsewhere), \
        r["served"]
    assert not (stored - elsewhere) & set(r["unserved"])
    assert all(row.get("why") or row.get("buckets") for row in r["layers"])
    regions = {(row["op"], row["layer"]) for row in r["layers"]}
    assert regions == {(c["kind"], m) for c in arch["capture"]["regions"] for m in c["modules"]}


def test_the_doctor_says_which_kinds_eager_mode_serves(arch):
    """The doctor's eager column, from the architecture's classes as capture recorded them, against
    what the eager engine ran: a stored kind it says eager mode serves ran, and one it says no layer
    serves did not (the single ops wherever vLLM runs them, whole regions only in the classes the
    eager hooks patch, Gemma's and the biased kinds never)."""
    r = _doctor(arch)
    ran = arch["runs"]["prism"]["runs"]["eager"]["kernel"]
    says = {k for k in _stored(arch) if r["served_eager"].get(k)}
    assert says == {k for k in _stored(arch) if ran.get(k, 0) > 0}, (r["served_eager"], ran)
    assert all(row["eager_why"] for row in r["layers"] if not row["eager"])
