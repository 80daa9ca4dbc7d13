"""`prism-serve warmup <model>`: capture -> optimize -> check against vLLM -> time -> store.

For each supported region of the model (as found by capture under the real vLLM) that the
plugin would serve (the region table's `served_sites`: a region no hook serves, or one that
runs inside a larger served region in both modes, is skipped and says so; largest regions go first, so a
region whose search fails leaves its parts to be warmed instead):
reuse the stored verified designs of its Program when the registry has any (shape-
generic: a design of the same Program family is rebuilt and re-verified, not searched again),
else search with Prism's generator (`optimize.pipeline.search`); instantiate the best
design for this device and each num_tokens bucket;
check it on the layer's real weights and the inputs vLLM saw against vLLM's own
outputs; on a GPU, time it against vLLM's own path (`baseline`); store every kernel with
its proof, checks and timings. These are the region's stages (`REGION_STAGES`, functions over one
`RegionRun` context), and what progress names. A region that fails (search, proof, its check against vLLM) is
reported with the reason and skipped, and the run goes on (`run_status`). Every speedup is against vLLM's path for the region
(`baseline`), modeled by the same cost model and, on a GPU, measured; a kernel is `enabled`
only when it measured faster;
on the CPU nothing is measured, so kernels stay `verified` (PRISM_SERVE_FORCE=1 uses them).

Kernels are for the dtype vLLM runs the model in, and keyed by it: warmup captures the model in
the dtype it is asked for (`dtype`, as `vllm serve --dtype`; "auto", vLLM's default, runs a float32
checkpoint in bfloat16), so the regions, their Programs and the outputs checked against are vLLM's
in that dtype.

A capture report is cached per model fingerprint (config, weight files, dtype, versions):
a second run whose regions all have kernels for this device finishes without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from prism_serve.errors import PrismError
from prism_serve.paths import cache_dir

log = logging.getLogger(__name__)
MAX_TOKENS = 1 << 20  # the last bucket serves every larger num_tokens
# (stage, done, total): the run entered `stage`; `done` of `total` regions are finished. Stages:
# "capture under vLLM", then per region "KIND (I/N): STAGE" for each of `REGION_STAGES` (or
# "KIND (I/N) not searched"), then "done".
Progress = Callable[[str, int, int], None]


@dataclass
class RegionOutcome:
    kind: str
    program_hash: str | None
    layers: list[int]
    buckets: list[tuple[int, int]] = field(default_factory=list)
    design: str = ""  # the winning design, described
    reused: bool = False  # rebuilt from stored designs, no search
    verified: bool = False
    vllm_max_rel_error: float | None = None  # vs vLLM's own outputs on the layer's real inputs
    # per bucket (in `buckets` order), over vLLM's path for the region: modeled, and measured on a GPU
    modeled_speedup: list[float] = field(default_factory=list)
    measured_speedup: list[float] = field(default_factory=list)
    baseline: str = ""  # what the measured speedup is against ("vllm", or "torch-eager" without vLLM)
    status: str = "skipped"  # enabled | verified | skipped | failed
    reason: str = ""


@dataclass
class WarmupReport:
    model: str
    device: str
    seconds: float
    nothing_new: bool
    regions: list[RegionOutcome]
    dtype: str = ""  # the dtype vLLM ran the model in, which every kernel stored is for

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "dtype": self.dtype, "seconds": self.seconds,
                "nothing_new": self.nothing_new, "regions": [asdict(r) for r in self.regions]}


def bucket_ranges(buckets: list[int]) -> list[tuple[int, int]]:
    """Sorted bucket sizes -> disjoint inclusive num_tokens ranges, each tuned at its upper end;
    the last one also serves everything above it."""
    sizes = sorted(set(buckets)) or [1]
    lows = [1] + [b + 1 for b in sizes[:-1]]
    return [(lo, hi) for lo, hi in zip(lows, sizes[:-1] + [MAX_TOKENS])]


def model_fingerprint(model_dir: Path, dtype: str = "auto") -> str:
    """What a capture depends on: the config, the weight files (name, size, mtime), the dtype asked
    of vLLM, the prompt whose forwards it records (what warmup checks kernels on), the versions."""
    from prism_serve.capture.child import RECORD_PROMPT
    from prism_serve.registry.store import current_versions

    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    h.update(f"dtype:{dtype}".encode())
    h.update(f"record:{RECORD_PROMPT}".encode())
    for p in sorted(model_dir.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".pt"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(asdict(current_versions()), sort_keys=True).encode())
    return h.hexdigest()[:24]


def cached_capture(key: str) -> dict | None:
    """The capture report stored under `key` (a model fingerprint), or None when there is none."""
    path = cache_dir() / "captures" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def store_capture(key: str, report: dict) -> None:
    """Store a capture report under `key`, for the next warmup of the same model and versions."""
    path = cache_dir() / "captures" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)  # atomic: a crash never leaves half a report behind


def have_kernels(session, region: dict, device, env) -> bool:
    """Every bucket of a supported region already has a compatible kernel for this device."""
    from prism_serve.registry.store import incompatibility, list_kernels

    have = {(k.bucket_lo, k.bucket_hi) for k in list_kernels(session, device=device.fingerprint,
                                                             program=region["program_hash"])
            if k.status in ("enabled", "verified") and not incompatibility(k, env)}
    return all(tuple(b) in have for b in bucket_ranges(region["buckets"]))


def _sites(region: dict) -> list:
    from prism_serve.region_table import Site
    return [Site(region["kind"], frozenset(m.split("+"))) for m in region["modules"]]


def region_span(region: dict) -> int:
    """How many modules the region's largest site covers: warmup serves larger regions first."""
    return max((len(s.modules) for s in _sites(region)), default=0)


def served_by(region: dict, regions: list[dict], classes: dict[str, str], failed=frozenset()) -> str | None:
    """None when the plugin would serve `region` with its own kernel at one of its sites at least, in
    compiled or in eager mode, else why not (the region table's rules, given every supported region
    of the capture but the `failed` sites, and the classes of the capture's modules)."""
    from prism_serve.region_table import served_sites

    everything = [s for r in regions if r["supported"] for s in _sites(r)]
    served = served_sites(everything, failed, classes)
    mine = _sites(region)
    if any(s in served and served[s] is None for s in mine):
        return None
    inside = sorted({o.kind for s in mine for o, cover in served.items() if cover is None and s.modules < o.modules})
    if inside:
        return f"the plugin serves it inside {', '.join(inside)}"
    return f"no plugin hook serves {region['kind']} at {'+'.join(sorted(mine[0].modules))}"


def all_stored(registry: str | None, cached: dict, device, env) -> list[dict] | None:
    """The regions of a cached capture that the plugin would serve, when every one of them has its
    kernels in the registry; else None (read only: a registry that does not exist holds nothing,
    and is not created here)."""
    from prism_serve.registry.db import open_registry
    from prism_serve.registry.errors import RegistryError

    served = [r for r in cached["regions"]
              if r["supported"] and served_by(r, cached["regions"], cached.get("classes", {})) is None]
    if not served:
        return None
    try:
        reg = open_registry(registry, readonly=True)
    except RegistryError:  # none yet, or one to upgrade or to report: the writing open does that
        return None
    try:
        with reg.read() as s:
            return served if all(have_kernels(s, r, device, env) for r in served) else None
    finally:
        reg.close()


def known_designs(session, prog) -> list:
    """Verified designs stored for this Program, or for any Program of the same family (name)
    whose design builds for it, as it is or with its slices' windows moved to this Program's
    (`design.rebased`: rotary's halves at another head dim): rebuilt (and verified again) for the
    new shapes instead of searching. A stored design and its Program are untrusted data: both are
    parsed by the typed loaders."""
    from sqlalchemy import select

    from prism_serve.errors import ProgramError, SGraphError
    from prism_serve.optimize.generate.design import Design, build, rebased
    from prism_serve.optimize.ir.schema import program_from_json
    from prism_serve.registry.models import ProgramRecord, SGraphRecord

    rows = session.execute(select(SGraphRecord.proof, ProgramRecord.hash, ProgramRecord.ir_json).join(
        ProgramRecord, SGraphRecord.program_id == ProgramRecord.id).where(ProgramRecord.name == prog.name)).all()
    rows = sorted(rows, key=lambda r: r[1] != prog.canonical_hash)  # this very Program's designs first
    designs = []
    for proof, _, ir_json in rows:
        if not isinstance(proof, dict) or not proof.get("ok") or "design" not in proof:
            continue
        try:
            design = Design.from_json(proof["design"])
            try:
                build(prog, design)
            except SGraphError:
                design = rebased(design, program_from_json(ir_json), prog)
                build(prog, design)
        except (ProgramError, SGraphError):
            continue
        if design not in designs:
            designs.append(design)
    return designs


def warmup(model: str | Path | None = None, *, registry: str | None = None, budget_s: float = 60.0,
           progress: Progress | None = None, dtype: str = "auto", ray: str | None = None,
           work: int | None = None) -> WarmupReport:
    """Capture, optimize, check and store kernels for `model` on this device (see the module doc),
    for the dtype vLLM runs it in: `dtype` as vLLM's own (`vllm serve --dtype`; "auto", vLLM's
    default, runs a float32 checkpoint in bfloat16). With `ray` (a cluster address, "auto", or
    "local") each search runs on Ray (`pipeline/ray_pool.py`). Each region's search generates for
    `work` steps (default: the search's, per second of `budget_s`), within `budget_s` seconds."""
    from prism_serve.capture.embedded import resolve_model
    from prism_serve.patch.device import current_device
    from prism_serve.registry.db import open_registry
    from prism_serve.registry.store import current_versions, finish_warmup, start_warmup

    start = time.perf_counter()
    model_dir = resolve_model(model)
    if not (model_dir / "config.json").is_file():
        from prism_serve.capture.runner import capture  # its validation gives the precise one-line error
        capture(model, dtype)
    name = str(model) if model is not None else model_dir.name
    device, device_type = current_device(use_vllm=False, measure=True)
    key = model_fingerprint(model_dir, dtype)
    env = current_versions()
    cached = cached_capture(key)
    stored = all_stored(registry, cached, device, env) if cached is not None else None
    if stored:
        return WarmupReport(name, device.fingerprint, time.perf_counter() - start, True, [
            RegionOutcome(r["kind"], r["program_hash"], r["layers"], [tuple(b) for b in bucket_ranges(r["buckets"])],
                          status="stored", reason="kernels already in the registry")
            for r in stored], cached.get("dtype", ""))
    from prism_serve.capture.runner import capture
    from prism_serve.registry.db import check_registry_writable

    check_registry_writable(registry)  # a registry that cannot be written fails now, not after the capture
    if progress:
        progress("capture under vLLM", 0, 1)
    captured = capture(model, dtype)  # before the registry is opened: a model that fails leaves no registry behind
    reg = open_registry(registry)
    try:
        with reg.write() as s:
            run_id = start_warmup(s, name, device)
        outcomes = []
        docs = [r.to_json() for r in captured.regions]
        supported = sorted((r for r in captured.regions if r.supported), key=lambda r: -region_span(r.to_json()))
        failed: set = set()
        for i, region in enumerate(supported):
            why = served_by(region.to_json(), docs, captured.classes, failed)
            if why is not None:
                if progress:
                    progress(f"{region.kind} ({i + 1}/{len(supported)}) not searched", i, len(supported))
                outcomes.append(RegionOutcome(region.kind, region.program.canonical_hash, region.layers,
                                              reason=f"not searched: {why}"))
                continue
            out = RegionOutcome(region.kind, region.program.canonical_hash, region.layers,
                                bucket_ranges(sorted(set(region.buckets)) or [1]))
            try:
                outcome = _warm_region(RegionRun(region, captured, name, reg, device, device_type, env, run_id,
                                                 budget_s, out, ray=ray, work=work), progress, i, len(supported))
            except Exception as exc:  # noqa: BLE001 - one region's failure is reported, the run goes on
                outcome = RegionOutcome(region.kind, region.program.canonical_hash, region.layers, status="failed",
                                        reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            if outcome.status == "failed":
                failed |= set(_sites(region.to_json()))
            outcomes.append(outcome)
        outcomes += [RegionOutcome(r.kind, None, r.layers, reason=r.reason or "unsupported")
                     for r in captured.regions if not r.supported]
        if progress:
            progress("done", len(supported), len(supported))
        report = WarmupReport(name, device.fingerprint, time.perf_counter() - start, False, outcomes, captured.dtype)
        with reg.write() as s:
            finish_warmup(s, run_id, run_status(outcomes), report.to_json())
        store_capture(key, captured.to_json())
        return report
    finally:
        reg.close()


def run_status(outcomes: list[RegionOutcome]) -> str:
    """A warmup run is "ok" when no region failed, "partial" when some failed but others were
    stored (each failure is reported and skipped, its parts warmed instead: one region never fails
    the whole run), "failed" when regions failed and none was stored."""
    if not any(o.status == "failed" for o in outcomes):
        return "ok"
    return "partial" if any(o.status in ("enabled", "verified") for o in outcomes) else "failed"


@dataclass
class RegionRun:
    """The explicit context a region's stages run over: what they are given, then what each
    stage adds for the next (`REGION_STAGES`). A stage returns None to go on, or why the region
    failed."""
    region: object  # capture's Region
    captured: object  # capture's report: the recorded forwards the check reads
    model: str
    reg: object  # the open Registry
    device: object  # DeviceInfo
    device_type: str  # "cuda" or "cpu"
    env: object  # the software versions kernels are stored under
    run_id: int
    budget_s: float
    out: RegionOutcome
    ray: str | None = None  # the Ray cluster the search runs on (None: this process)
    work: int | None = None  # the search's generation steps (None: per second of `budget_s`)
    spec: object = None  # the GPU spec the search ranks for
    designs: list = field(default_factory=list)  # verified designs stored for this Program (family)
    best: object = None  # the search's winner
    kernels: dict = field(default_factory=dict)  # bucket range -> the winner's instance for it
    checks: dict = field(default_factory=dict)  # bucket range -> (error against vLLM, its limit)
    limit: float = 0.0  # the limit of the check nearest to (or furthest past) it
    checked_tokens: list = field(default_factory=list)
    vllm_modeled: dict = field(default_factory=dict)  # bucket range -> vLLM's path, modeled us
    against: str | None = None  # what the GPU timings are against
    timings: dict = field(default_factory=dict)  # bucket range -> (measured us, baseline us)

    @property
    def prog(self):
        return self.region.program

    @property
    def sizes(self) -> list[int]:
        return sorted(set(self.region.buckets)) or [1]


def _stored_designs(run: RegionRun) -> str | None:
    from prism_serve.optimize.target.gpus import get_gpu
    from prism_serve.patch.table import CPU_BOUNDS_GPU

    run.spec = run.device.spec or get_gpu(run.device.name if run.device.kind == "gpu" else CPU_BOUNDS_GPU)
    with run.reg.read() as s:
        run.designs = known_designs(s, run.prog)
    return None


def _search(run: RegionRun) -> str | None:
    from prism_serve.optimize.pipeline.search import optimize

    # one process: on two cores the workers' start-up (5-10 s) costs more than they save (see #11's notes);
    # on a GPU, only instances that ptxas does not spill for it (compiled by the Triton vLLM will launch with),
    # and the measured best of three verified designs; without one the modeled best is stored, the first
    # to verify (verifying two more took 7 s of an MoE region's 18 s)
    gpu = run.device.kind == "gpu"

    def search(known=()):
        return optimize(run.prog, run.spec, run.sizes, budget_s=run.budget_s, work=run.work, known=known,
                        top=3 if gpu else 1, workers=1 if run.ray is None else None, static_check=gpu, ray=run.ray)
    try:
        result = search(run.designs)
        if run.designs and not result.found:  # stored designs no longer verify here: search afresh
            result, run.designs = search(), []
    except PrismError as exc:
        return f"optimizer: {exc}"
    if not result.found:
        return " ".join(filter(None, ["no verified kernel", result.stats.limit()]))
    run.best = result.best
    run.out.reused, run.out.design, run.out.verified = bool(run.designs), run.best.design.describe(), True
    run.kernels = {rng: run.best.kernel_for(size) for rng, size in zip(run.out.buckets, run.sizes)}
    return None


def _check(run: RegionRun) -> str | None:
    try:
        run.checks, run.checked_tokens = _check_against_vllm(run.prog, run.kernels, run.captured, run.device_type)
    except PrismError as exc:
        return f"check against vLLM: {exc}"
    worst = max(run.checks, key=lambda rng: run.checks[rng][0] / run.checks[rng][1])
    run.out.vllm_max_rel_error, run.limit = run.checks[worst]
    if run.out.vllm_max_rel_error > run.limit:
        return (f"the {worst[0]}-{worst[1]} tokens kernel differs from vLLM's output by "
                f"{run.out.vllm_max_rel_error:.2e} (limit {run.limit:.2e})")
    return None


def _speedup(run: RegionRun) -> str | None:
    """Over vLLM's path for the region: modeled, and on a GPU measured."""
    from prism_serve.baseline import served_modeled_us, vllm_modeled_us

    run.vllm_modeled = {rng: vllm_modeled_us(run.prog, c.num_tokens, run.spec) for rng, c in run.kernels.items()}
    run.out.modeled_speedup = [run.vllm_modeled[rng] / served_modeled_us(run.prog, c.modeled_us, c.num_tokens, run.spec)
                               for rng, c in run.kernels.items()]
    if run.device_type == "cuda":
        run.against, run.timings = _time_against_vllm(run.prog, run.kernels)
    run.out.baseline = run.against or ""
    return None


def _store(run: RegionRun) -> str | None:
    """Every bucket's kernel through the registry's gate (proven and checked at the stored
    instantiation), then into the registry."""
    from prism_serve.optimize.instantiate.static import facts_json
    from prism_serve.registry.gate import admit
    from prism_serve.registry.store import KernelResult, add_kernels

    prog, best, out, kernels, timings = run.prog, run.best, run.out, run.kernels, run.timings
    path = "vLLM's own path" if run.against == "vllm" else "torch eager (vLLM not installed)"
    # on a GPU, ptxas's registers and spills of each range's kernel, compiled for it by the search
    ptxas = {"ptxas": {f"{lo}-{hi}": facts_json(k.facts) for (lo, hi), k in kernels.items()}
             } if any(k.facts is not None for k in kernels.values()) else {}
    results = []
    for (rng, c), modeled_speedup in zip(kernels.items(), out.modeled_speedup):
        measured, baseline = timings.get(rng, (None, None))
        faster = measured is not None and measured < baseline
        status = "enabled" if faster else "verified"
        reason = (f"measured faster than {path}" if faster else
                  f"measured slower than {path}" if measured is not None else
                  "not measured: no GPU here (modeled only)")
        results.append(KernelResult(
            program=prog, sgraph=best.sgraph, device=run.device, dtype=prog.inputs[0].attr("dtype"), bucket=rng,
            params=c.assignment, versions=run.env, status=status, reason=reason, modeled_us=c.modeled_us,
            measured_us=measured, baseline=run.against if baseline is not None else None, baseline_us=baseline,
            baseline_modeled_us=run.vllm_modeled[rng], modeled_speedup=modeled_speedup,
            proof={"ok": best.proof.ok, "reason": best.proof.reason, "seconds": best.proof.seconds,
                   "design": best.design.to_json()},
            tests={"small_instance_max_rel_error": best.numeric_error,
                   "vllm_max_rel_error": out.vllm_max_rel_error, "vllm_error_limit": run.limit,
                   "vllm_checked_tokens": run.checked_tokens,
                   "vllm_checks": {f"{lo}-{hi}": {"max_rel_error": e, "limit": lim}
                                   for (lo, hi), (e, lim) in run.checks.items()},
                   **ptxas},
            sources=tuple((run.model, m) for m in run.region.modules), warmup_run_id=run.run_id))
    try:
        results = admit(results)
    except PrismError as exc:
        return str(exc)
    with run.reg.write() as s:
        add_kernels(s, results)
    out.measured_speedup = [timings[rng][1] / timings[rng][0] for rng in kernels if rng in timings]
    out.status = "enabled" if all(r.status == "enabled" for r in results) else "verified"
    out.reason = results[0].reason if len({r.reason for r in results}) == 1 else "; ".join(
        f"{r.bucket[0]}-{r.bucket[1]}: {r.reason}" for r in results)
    return None


# A region's warmup, in order; each name is what progress shows while it runs.
REGION_STAGES: tuple[tuple[str, Callable[[RegionRun], str | None]], ...] = (
    ("stored designs", _stored_designs),
    ("search", _search),
    ("check against vLLM", _check),
    ("speedup over vLLM", _speedup),
    ("gate and store", _store),
)


def _warm_region(run: RegionRun, progress: Progress | None = None, done: int = 0, total: int = 1) -> RegionOutcome:
    """Run `REGION_STAGES` over `run` until one fails (the outcome then says why, unverified)."""
    for name, stage in REGION_STAGES:
        if progress:
            progress(f"{run.out.kind} ({done + 1}/{total}): {name}", done, total)
        why = stage(run)
        if why is not None:
            run.out.status, run.out.reason, run.out.verified = "failed", why, False
            break
    return run.out


def _check_against_vllm(prog, kernels: dict, captured, device_type: str
                        ) -> tuple[dict[tuple[int, int], tuple[float, float]], list[int]]:
    """Per bucket range, the relative error of its kernel's outputs against vLLM's over the recorded
    forwards of the layers running this Program, and the limit it is held to
    (`reference.agreement_limit` of the exact result on the same inputs): of the forward nearest its
    limit, or past it furthest; and the token counts of those forwards. Every range's kernel runs
    on every forward of its range in every layer, and on the forwards of other sizes in the first
    layer (a kernel serves any num_tokens, its range only chose its tiles: a decode kernel on the
    prefill runs many more of its tiles than a decode does, and a range that no recorded forward
    falls in is checked too). Ranges tuned to the same instantiation, checked on the same forwards,
    share one check."""
    import torch

    from prism_serve.errors import CodegenError
    from prism_serve.optimize.codegen.render import compile_instance
    from prism_serve.optimize.ir.reference import agreement_limit, evaluate, max_rel_error

    layers = [inst for inst in captured.instances
              if inst.program is not None and inst.program.canonical_hash == prog.canonical_hash]
    # (first layer?, inputs, outputs) per recorded forward
    forwards = [(i == 0, inputs, outputs) for i, inst in enumerate(layers) for _, inputs, outputs in inst.recordings]
    if not forwards:
        raise CodegenError(f"capture recorded no forward of {prog.name} to check against")
    dev = "cuda" if device_type == "cuda" else "cpu"
    exact = [evaluate(prog, [t.cpu() for t in inputs], precision=torch.float64) for _, inputs, _ in forwards]
    checks, shared = {}, {}
    for rng, kernel in kernels.items():
        on = tuple(j for j, (first, inputs, _) in enumerate(forwards)
                   if first or rng[0] <= inputs[0].shape[0] <= rng[1])
        key = (tuple(sorted(kernel.instance.values.items())), on)
        if key in shared:
            checks[rng] = shared[key]
            continue
        run = compile_instance(kernel.instance)
        worst = (0.0, 1.0)
        for j in on:
            (_, inputs, outputs), want_exact = forwards[j], exact[j]
            got = run(*(t.to(dev).contiguous() for t in inputs))
            for o, g, want, x in zip(prog.outputs, got, outputs, want_exact):
                case = (max_rel_error(g.to(torch.float32).cpu(), want.to(torch.float32)),
                        agreement_limit(x, prog.types[o].dtype))
                worst = max(worst, case, key=lambda c: c[0] / c[1])
        checks[rng] = shared[key] = worst
    return checks, sorted({inputs[0].shape[0] for _, inputs, _ in forwards})


def _time_against_vllm(prog, kernels: dict) -> tuple[str, dict]:
    """On the GPU: median time of what the plugin runs for each range's kernel (`baseline.served`)
    and of vLLM's own path (`baseline.baseline`), at the range's tuned size, on the same inputs."""
    from prism_serve.baseline import baseline, served
    from prism_serve.optimize.codegen.render import compile_instance
    from prism_serve.optimize.ir.reference import random_inputs
    from prism_serve.optimize.instantiate.timing import median_us

    vllm = baseline(prog)
    out = {}
    for rng, c in kernels.items():
        sets = [random_inputs(prog, c.num_tokens, seed=i, device="cuda") for i in range(4)]
        prepare, run = served(prog, compile_instance(c.instance))
        out[rng] = (median_us(run, [prepare(s) for s in sets]), median_us(vllm.run, [vllm.prepare(s) for s in sets]))
    return vllm.name, out
