"""`prism-serve fleet warmup MODEL... --ray ADDRESS --registry URL` (#39): warm every (model, GPU
kind) pair a Ray cluster can serve into one shared registry.

The GPU kinds are the cluster's: Ray's `accelerator_type:KIND` resources on its live nodes
(`gpu_kinds`). Per model the driver captures it once (vLLM, here) and searches and proves each
served region's Program once, its subtrees Ray tasks anywhere (sGraphs are device-independent:
`pipeline/ray_pool.py`); nodes without a GPU thus do search and verification only. Then one
task per GPU kind, pinned to a node of that kind (`resources={"accelerator_type:KIND": ...}`),
instantiates the verified designs for that GPU (ranking, ptxas's static check, on a GPU the
measurement), checks them against vLLM's recorded outputs, and stores them through the
registry's gate with the device they ran on (warmup's own stages, `warmup.REGION_STAGES`).

A node with no CUDA device (a simulated cluster) cannot measure: its task stores the modeled,
tuned result for its kind's spec, exactly as warmup does without a GPU (status ``verified``,
"not measured"), under the fingerprint of the kind's known spec, and the summary says so.

Faults: a search worker killed is rerun by Ray with the same result (`ray_pool`); a kind task
stores each region in one transaction, so a run killed half-way leaves only whole regions, and
a rerun skips every (model, kind, region) the registry already holds (a model whose every kind
is held is not even captured again); a kind whose last node is lost, or whose task fails, is
reported as not warmed while the other kinds finish."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from prism_serve.errors import PrismError

log = logging.getLogger(__name__)
KIND_PREFIX = "accelerator_type:"
PIN = 0.01  # of a node's accelerator_type resource: what pins a task there (Ray's convention)
POLL_S = 0.5  # how often the driver checks that each kind still has a node
DRIVER_STAGES = ("stored designs", "search")  # warmup's region stages the driver runs once per Program
MEASURE_TOP = 5  # instances timed per bucket on a device (the search's default)
TASK_S = 600.0  # beyond the budget: how long a kind task may take per region (checks, ptxas, storing)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class KindOutcome:
    """One (model, GPU kind) pair: what its pinned task did."""

    model: str
    kind: str
    device: str = ""  # the fingerprint its rows are stored under
    measured: bool = False  # on a real device of the kind; else modeled for its spec
    stored: int = 0  # regions stored by this run
    held: int = 0  # regions the registry already held (a resumed run)
    failed: tuple[str, ...] = ()  # "region: reason"
    status: str = "ok"  # ok | partial | failed | lost
    reason: str = ""
    seconds: float = 0.0  # the pinned task's own time


@dataclass
class FleetReport:
    models: list[str]
    kinds: list[str]
    seconds: float = 0.0
    rows: list[KindOutcome] = field(default_factory=list)

    def to_json(self) -> dict:
        from dataclasses import asdict
        return {"models": self.models, "kinds": self.kinds, "seconds": self.seconds,
                "rows": [asdict(r) for r in self.rows]}


def gpu_kinds(ray) -> dict[str, dict]:
    """KIND -> the resources of one live node of that kind, from the cluster's nodes."""
    kinds: dict[str, dict] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for res in node.get("Resources", {}):
                if res.startswith(KIND_PREFIX):
                    kinds.setdefault(res[len(KIND_PREFIX):], node["Resources"])
    return dict(sorted(kinds.items()))


def kind_device(kind: str):
    """(DeviceInfo, torch device type, measured) for a task on a node of `kind`: the CUDA device
    when there is one (its spec measured, as warmup does), else the kind's known spec, modeled."""
    import torch

    from prism_serve.optimize.target.gpus import canonical_name, get_gpu
    from prism_serve.registry.store import DeviceInfo

    if torch.cuda.is_available():
        from prism_serve.patch.device import current_device
        device, device_type = current_device(use_vllm=False, measure=True)
        return device, device_type, True
    return DeviceInfo.from_spec(get_gpu(canonical_name(kind))), "cpu", False


def _served(captured) -> list:
    """The capture's regions the plugin would serve, largest first (as warmup orders them)."""
    from prism_serve.warmup import region_span, served_by

    docs = [r.to_json() for r in captured.regions]
    return sorted((r for r in captured.regions if r.supported and
                   served_by(r.to_json(), docs, captured.classes) is None), key=lambda r: -region_span(r.to_json()))


def search_regions(captured, registry: str | None, budget_s: float, ray: str, spec_name: str,
                   workers: int | None = None, work: int | None = None) -> dict:
    """Program hash -> its verified designs (`Found`, ranked for `spec_name`), or the reason it
    has none: each served region's Program searched once on the cluster, by `workers` actors
    (default: the cluster's CPUs) for `work` steps (default: the search's, per second of
    `budget_s`); its stored designs reused and verified again where the registry has them."""
    from prism_serve.optimize.pipeline.search import optimize
    from prism_serve.registry.db import open_registry
    from prism_serve.warmup import known_designs

    out: dict = {}
    reg = open_registry(registry)
    try:
        for region in _served(captured):
            prog, sizes = region.program, sorted(set(region.buckets)) or [1]
            if prog.canonical_hash in out:
                continue
            with reg.read() as s:
                known = known_designs(s, prog)
            try:
                result = optimize(prog, spec_name, sizes, budget_s=budget_s, known=known, ray=ray, workers=workers)
                if known and not result.found:
                    result = optimize(prog, spec_name, sizes, budget_s=budget_s, work=work, ray=ray, workers=workers)
            except PrismError as exc:
                out[prog.canonical_hash] = f"optimizer: {exc}"
                continue
            out[prog.canonical_hash] = list(result.found) or " ".join(
                filter(None, ["no verified kernel", result.stats.limit()]))
    finally:
        reg.close()
    return out


def warm_kind(kind: str, model: str, captured, found: dict, registry: str | None, budget_s: float) -> KindOutcome:
    """The pinned task: every served region of `captured` instantiated for this node's device
    (its kind), checked against vLLM's recorded outputs and stored; regions the registry already
    holds for the device are skipped."""
    import torch
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    from prism_serve.optimize.target.gpus import get_gpu
    from prism_serve.registry.db import open_registry
    from prism_serve.registry.store import current_versions, finish_warmup, start_warmup
    from prism_serve.warmup import REGION_STAGES, RegionOutcome, RegionRun, bucket_ranges, have_kernels, run_status

    start = time.perf_counter()
    device, device_type, measured = kind_device(kind)
    spec = device.spec or get_gpu(device.name)
    env = current_versions()
    stored, held, failed, outcomes = 0, 0, [], []
    reg = open_registry(registry)
    try:
        with reg.write() as s:
            run_id = start_warmup(s, model, device)
        for region in _served(captured):
            doc = region.to_json()
            with reg.read() as s:
                if have_kernels(s, doc, device, env):
                    held += 1
                    continue
            out = RegionOutcome(region.kind, region.program.canonical_hash, region.layers,
                                bucket_ranges(sorted(set(region.buckets)) or [1]))
            designs = found.get(region.program.canonical_hash)
            run = RegionRun(region, captured, model, reg, device, device_type, env, run_id, budget_s, out, spec=spec)
            try:
                why = designs if isinstance(designs, str) else _instantiate(run, designs, measured)
                for name, stage in REGION_STAGES if why is None else ():
                    if name not in DRIVER_STAGES:
                        why = stage(run)
                        if why is not None:
                            break
            except Exception as exc:  # noqa: BLE001 - one region's failure is reported, the others go on
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            if why is None:
                stored += 1
            else:
                out.status, out.reason = "failed", why
                failed.append(f"{region.kind}: {why}")
            outcomes.append(out)
        with reg.write() as s:
            finish_warmup(s, run_id, run_status(outcomes), {"fleet": True, "kind": kind, "measured": measured,
                                                            "regions": [o.kind + ":" + o.status for o in outcomes]})
    finally:
        reg.close()
    status = "failed" if failed and not stored and not held else "partial" if failed else "ok"
    return KindOutcome(model, kind, device.fingerprint, measured, stored, held, tuple(failed), status,
                       "" if measured else "modeled only: no CUDA device on the node (warmup's CPU path)",
                       time.perf_counter() - start)


def _instantiate(run, designs: list, measured: bool) -> str | None:
    """The search's designs instantiated for `run.spec` (the kind's GPU) as the search does it:
    ranked again for it and, on its device, screened by ptxas for its architecture and the top
    ones timed (without one, the modeled best, as warmup on a CPU)."""
    from prism_serve.optimize.instantiate.timing import cuda_timer
    from prism_serve.optimize.instantiate.tune import SCREEN_DEPTH
    from prism_serve.optimize.pipeline.instances import Verified, instantiate, rankings
    from prism_serve.optimize.pipeline.search import SearchStats

    if not designs:
        return "no verified kernel"
    sizes = tuple(run.sizes)
    timer = cuda_timer(run.prog, run.spec) if measured else None
    keep = (MEASURE_TOP if measured else 1) + (SCREEN_DEPTH if measured else 0)
    verified = [Verified(f.design, f.sgraph, f.proof, f.numeric_error,
                         tuple(tuple(r[:keep]) for r in rankings(f.sgraph, run.spec, sizes, keep))) for f in designs]
    try:
        found = instantiate(verified, run.spec, timer, MEASURE_TOP, SearchStats(), static_check=measured)
    except PrismError as exc:
        return f"instantiate for {run.spec.name}: {exc}"
    found.sort(key=lambda f: sum(c.measured_us if c.measured_us is not None else c.modeled_us for c in f.kernels))
    run.best = found[0]
    run.out.design, run.out.verified = run.best.design.describe(), True
    run.kernels = {rng: run.best.kernel_for(size) for rng, size in zip(run.out.buckets, run.sizes)}
    return None


def fleet_warmup(models: list[str], *, address: str, registry: str | None = None, budget_s: float = 60.0,
                 dtype: str = "auto", progress: Progress | None = None, capture: Callable | None = None,
                 workers: int | None = None, only: Sequence[str] = (), work: int | None = None) -> FleetReport:
    """Warm every (model, GPU kind) pair of the Ray cluster at `address` into `registry` (see the
    module doc), each search on `workers` Ray actors (default: the cluster's CPUs) for `work` steps
    (default: the search's, per second of `budget_s`); with `only`, just those of the cluster's GPU
    kinds.
    `capture(model, dtype)` is capture's own (`capture.runner.capture`) unless given."""
    from prism_serve.optimize.pipeline.ray_pool import RayError, ray_module, ray_session
    from prism_serve.registry.db import resolve_url

    ray = ray_module()
    start = time.perf_counter()
    registry = resolve_url(registry)  # every node writes to the one the driver names
    if capture is None:
        from prism_serve.capture.runner import capture
    with ray_session(address):
        kinds = gpu_kinds(ray)
        missing = sorted(set(only) - set(kinds))
        if missing:
            raise RayError(f"the Ray cluster at {address} has no live node of GPU kind {', '.join(missing)} "
                           f"(it has: {', '.join(kinds) or 'none'})")
        kinds = {k: v for k, v in kinds.items() if not only or k in only}
        if not kinds:
            raise RayError(f"the Ray cluster at {address} has no node with an {KIND_PREFIX}* resource: "
                           "no GPU kind to warm for")
        report = FleetReport(list(models), list(kinds))
        for model in models:
            report.rows += _warm_model(ray, model, kinds, registry, budget_s, dtype, progress, capture, address,
                                       workers, work)
    report.seconds = time.perf_counter() - start
    return report


def _table_device(kind: str):
    from prism_serve.optimize.target.gpus import canonical_name, get_gpu
    from prism_serve.registry.store import DeviceInfo
    return DeviceInfo.from_spec(get_gpu(canonical_name(kind)))


def _warm_model(ray, model: str, kinds: dict, registry: str, budget_s: float, dtype: str,
                progress: Progress | None, capture: Callable, address: str, workers: int | None,
                work: int | None) -> list[KindOutcome]:
    """One model: the kinds the registry does not hold yet, captured and searched once, then a
    pinned task per kind, waited for while its kind has a live node."""
    from prism_serve.capture.embedded import resolve_model
    from prism_serve.registry.store import current_versions
    from prism_serve.warmup import all_stored, cached_capture, model_fingerprint, store_capture

    say = progress or (lambda message: None)
    key = model_fingerprint(resolve_model(model), dtype)
    cached, env = cached_capture(key), current_versions()
    rows, pending = [], []
    for kind in kinds:
        held = cached is not None and all_stored(registry, cached, _table_device(kind), env)
        if held:
            rows.append(KindOutcome(model, kind, _table_device(kind).fingerprint, held=len(held),
                                    reason="already in the registry"))
            say(f"{model} on {kind}: already in the registry")
        else:
            pending.append(kind)
    if not pending:
        return rows
    say(f"{model}: capture")
    try:
        captured = capture(model, dtype)
        store_capture(key, captured.to_json())
        say(f"{model}: search and proof on the cluster")
        found = search_regions(captured, registry, budget_s, address, _table_device(pending[0]).name, workers,
                               work)
    except PrismError as exc:  # this model is reported, the others go on
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return rows + [KindOutcome(model, kind, status="failed", reason=why) for kind in pending]
    task, shared, found_ref = ray.remote(warm_kind), ray.put(captured), ray.put(found)
    refs = {}
    for kind in pending:
        opts = {"num_cpus": 1, "resources": {KIND_PREFIX + kind: PIN}, "max_retries": 2}
        if kinds[kind].get("GPU"):
            opts["num_gpus"] = 1
        refs[task.options(**opts).remote(kind, model, shared, found_ref, registry, budget_s)] = kind
        say(f"{model} on {kind}: instantiate, check, store")
    until = time.time() + (budget_s + TASK_S) * max(1, len(_served(captured)))
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
        for ref in ready:
            kind = refs.pop(ref)
            try:
                rows.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                lost = kind not in gpu_kinds(ray)
                rows.append(KindOutcome(model, kind, status="lost" if lost else "failed",
                                        reason=f"no live node of kind {kind} is left" if lost else
                                        str(exc).strip().splitlines()[0][:300]))
            say(f"{model} on {kind}: {rows[-1].status}")
        alive = gpu_kinds(ray)
        for ref, kind in list(refs.items()):
            lost, late = kind not in alive, time.time() > until
            if lost or late:
                ray.cancel(ref, force=True)
                del refs[ref]
                rows.append(KindOutcome(model, kind, status="lost" if lost else "failed",
                                        reason=f"no live node of kind {kind} is left" if lost else
                                        "its task outlived the time allowed"))
                say(f"{model} on {kind}: {rows[-1].status}")
    return sorted(rows, key=lambda r: list(kinds).index(r.kind))
