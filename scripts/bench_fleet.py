"""Benchmark the search and fleet warmup on Ray (#39), on this machine.

    python scripts/bench_fleet.py --json FILE [--work 1000000] [--fleet-budget 20] [--scale 1] [--skip-search]
        [--skip-fleet]

1. search: each of the five Prism workloads (default shapes, the largest default num_tokens, as
   `bench_search.py`) searched with two local worker processes (`--workers 2`) and on a local Ray
   cluster of 2 CPUs (`--ray local`), for `--work` steps with a wall-clock budget (600 s) that does
   not cut them on a loaded machine: whether the verified design hashes are the same, and the two
   wall times (the cluster's own start, once, apart).
2. fleet: a cluster simulated with `ray.cluster_utils.Cluster` on loopback (a head of 2 CPUs, and
   one node of 1 CPU per fake `accelerator_type:` H100, A100, L4) warms Llama-3-8B's served regions
   (its dims in float32, a simulated capture: random recorded inputs, the reference's outputs; the
   interpreter cannot check bf16 matmuls) with `fleet.fleet_warmup`, one kind per call (this
   machine's memory holds one pinned task checking those projections at a time, not three).
   `--scale K` divides every dim of Llama-3-8B's by K (the check against the recorded outputs
   runs the kernels through Triton's interpreter: at full size, over 5 minutes per region and kind
   here), and the results say so. Per task kind: count and median
   seconds inside Ray (generation subtrees and verifications from `ray_pool`'s log records, the
   pinned per-kind tasks from their outcome), and the PROJECTED wall time of the same warmup on 64
   CPUs: each generation round and the verifications at max(longest task, their sum / 64) instead
   of the same on the 2 CPUs measured, the driver's own time unchanged, the kinds' pinned tasks side
   by side. A projection from measured durations, not a measurement: no 64-CPU cluster was run.
   vLLM's capture of the model is not simulated (it runs once per model, on the driver) and is
   excluded. Nothing is measured on a GPU (none here): the pinned tasks store modeled results.

Timings on a shared, loaded machine are noisy; rerun on a quiet one before quoting them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the numeric check runs through the interpreter on CPUs
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on loopback only

import ray  # noqa: E402

from prism_serve.capture.runner import CaptureResult, Instance, Region  # noqa: E402
from prism_serve.fleet import fleet_warmup  # noqa: E402
from prism_serve.optimize.ir.canonical import canonical_hash  # noqa: E402
from prism_serve.optimize.ir.reference import evaluate, random_inputs  # noqa: E402
from prism_serve.optimize.pipeline.search import optimize  # noqa: E402
from prism_serve.optimize.workloads.programs import PRISM_WORKLOADS, get_workload  # noqa: E402
from prism_serve.region_table import KINDS  # noqa: E402

CPUS = 64  # the cluster the fleet figures are projected to
GPU_KINDS = ("H100", "A100", "L4")
# Llama-3-8B (hidden 4096, 32 heads and 8 kv heads of 128, intermediate 14336): its served regions,
# each at one site of its own (module paths as vLLM names them)
LLAMA3_8B = (
    ("rmsnorm_linear", {"hidden": 4096, "out": 6144}, "layers.0.input_layernorm+layers.0.self_attn.qkv_proj"),
    ("fused_add_rmsnorm_linear", {"hidden": 4096, "out": 6144},
     "layers.1.input_layernorm+layers.1.self_attn.qkv_proj"),
    ("rmsnorm_swiglu", {"hidden": 4096, "intermediate": 14336},
     "layers.0.post_attention_layernorm+layers.0.mlp.gate_up_proj+layers.0.mlp.act_fn"),
    ("fused_add_rms_norm", {"hidden": 4096}, "norm"),
)
TOKENS = 8  # the recorded forward each region is checked on


class TaskLog(logging.Handler):
    """`ray_pool`'s answers as they come: (task kind, seconds in the actor, (depth, round))."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.tasks: list[tuple[str, float, tuple | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "task"):
            self.tasks.append((record.task, record.seconds, record.step))


SEARCH_BUDGET_S = 600.0  # a safety net only: the work budget decides the result


def search_check(work: int) -> dict:
    """Part 1: `--workers 2` against a local Ray cluster of 2 CPUs, per workload."""
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    start_s = time.perf_counter() - t0
    out = {"cluster_start_s": start_s, "work": work, "budget_s": SEARCH_BUDGET_S, "workloads": {}}
    try:
        print(f"{'workload':<18} {'same hashes':>11} {'workers 2 s':>11} {'ray s':>7} {'ratio':>6} "
              f"{'ratio with start':>16}", flush=True)
        for name in PRISM_WORKLOADS:
            w = get_workload(name)
            prog, n = w.program(), (w.default_num_tokens or (1,))[-1]
            runs = {}
            for mode, kw in (("workers2", {"workers": 2}), ("ray", {"ray": "local"})):
                t = time.perf_counter()
                result = optimize(prog, "h100", (n,), budget_s=SEARCH_BUDGET_S, work=work, **kw)
                runs[mode] = (time.perf_counter() - t, [canonical_hash(f.sgraph) for f in result.found],
                              result.stats.stopped_by_budget)
            (local_s, local_h, local_cut), (ray_s, ray_h, ray_cut) = runs["workers2"], runs["ray"]
            r = out["workloads"][name] = {
                "num_tokens": n, "same_hashes": local_h == ray_h, "workers2_s": local_s, "ray_s": ray_s,
                "ratio": ray_s / local_s, "ratio_with_cluster_start": (ray_s + start_s) / local_s,
                "verified_hashes": local_h, "ray_verified_hashes": ray_h,
                "stopped_by_budget": [local_cut, ray_cut]}
            print(f"{name:<18} {str(r['same_hashes']):>11} {local_s:>11.1f} {ray_s:>7.1f} {r['ratio']:>6.2f} "
                  f"{r['ratio_with_cluster_start']:>16.2f}", flush=True)
    finally:
        ray.shutdown()
    print(f"(the local cluster's start, {start_s:.1f} s, is paid once per command)")
    return out


def llama3_capture(model, dtype: str = "auto", scale: int = 1) -> CaptureResult:
    """Llama-3-8B's served regions (every dim divided by `scale`) as a capture would report them,
    recorded on random inputs."""
    regions, instances = [], []
    for i, (kind, dims, site) in enumerate(LLAMA3_8B):
        dims = {k: v // scale for k, v in dims.items()}
        prog = KINDS[kind].program(dims, "float32", 1e-5)
        inputs = random_inputs(prog, TOKENS, seed=i)
        instances.append(Instance(kind, i, site.split("+"), dims, 1e-5, "float32", True, None, prog,
                                  [(TOKENS, inputs, evaluate(prog, inputs))]))
        regions.append(Region(kind, prog, dims, 1e-5, "float32", True, None, [i], [site], 1.0 / len(LLAMA3_8B),
                              [TOKENS]))
    classes = {m: "RMSNorm" for _, _, site in LLAMA3_8B for m in site.split("+") if m.endswith(("norm", "layernorm"))}
    return CaptureResult(str(model), "LlamaForCausalLM", "dummy", regions, instances, {TOKENS: 1}, [TOKENS],
                         [TOKENS], 0.0, classes=classes, dtype="float32")


def _wall(durations: list[float], cpus: int) -> float:
    return max(max(durations), sum(durations) / cpus) if durations else 0.0


def fleet_bench(budget: float, scale: int) -> dict:
    """Part 2: the simulated cluster's fleet warmup, its task durations and the 64-CPU projection."""
    from ray.cluster_utils import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="prism-bench-fleet-"))
    model = tmp / "llama-3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                                   "intermediate_size": 14336, "num_hidden_layers": 32}))
    os.environ["PRISM_SERVE_CACHE"] = str(tmp / "cache")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    log = TaskLog()
    logging.getLogger("prism_serve.optimize.pipeline.ray_pool").addHandler(log)
    logging.getLogger("prism_serve.optimize.pipeline.ray_pool").setLevel(logging.INFO)
    try:
        for kind in GPU_KINDS:
            c.add_node(num_cpus=1, resources={f"accelerator_type:{kind}": 1})
        c.wait_for_nodes(timeout=120)
        ray.init(address=c.address, log_to_driver=False)
        # one kind at a time: three pinned tasks checking Llama-3-8B's projections side by side need more
        # memory than this machine has; the first call also captures and searches, the later ones reuse
        # its designs (stored), so only the first's search is counted
        rows, walls, searched = [], [], 0
        for kind in GPU_KINDS:
            t = time.perf_counter()
            report = fleet_warmup([str(model)], address=c.address, registry=f"sqlite:///{tmp / 'registry.db'}",
                                  budget_s=budget, capture=lambda m, d: llama3_capture(m, d, scale), workers=2,
                                  only=(kind,),
                                  progress=lambda m: print(f"  fleet: {m}", flush=True))
            walls.append(time.perf_counter() - t)
            rows += report.rows
            searched = searched or len(log.tasks)
        wall = walls[0]
    finally:
        ray.shutdown()
        c.shutdown()
    log.tasks = log.tasks[:searched]
    report.rows = rows
    rounds: dict[tuple, list[float]] = defaultdict(list)
    verify: list[float] = []
    for task, seconds, step in log.tasks:
        (rounds[step] if task == "generate" else verify).append(seconds)
    # the measured cluster ran these on 2 actors; on 64 CPUs each round takes max(longest, sum / 64)
    tasks_here = sum(_wall(d, 2) for d in rounds.values()) + _wall(verify, 2)
    tasks_there = sum(_wall(d, CPUS) for d in rounds.values()) + _wall(verify, CPUS)
    pinned = {r.kind: r.seconds for r in report.rows}
    search_wall = wall - pinned[GPU_KINDS[0]]  # the first call: capture, search, then its kind's pinned task
    kinds = {"generate subtree": [s for d in rounds.values() for s in d], "verify design": verify,
             "instantiate, check, store (per kind)": list(pinned.values())}
    per_kind = {k: {"count": len(v), "median_s": statistics.median(v) if v else None} for k, v in kinds.items()}
    projected = (search_wall - tasks_here + tasks_there) + max(pinned.values(), default=0.0)
    print(f"{'task':<38} {'count':>5} {'median s':>9}")
    for k, v in per_kind.items():
        print(f"{k:<38} {v['count']:>5} {v['median_s'] if v['median_s'] is not None else float('nan'):>9.2f}")
    for r in report.rows:
        print(f"  {r.kind}: {r.status}, {r.stored} regions stored on {r.device} ({r.reason or 'measured'}) "
              f"in {r.seconds:.1f} s{'; ' + '; '.join(r.failed) if r.failed else ''}")
    print(f"measured here (2+{len(GPU_KINDS)} CPUs, simulated; kinds one after another): "
          f"{', '.join(f'{w:.1f}' for w in walls)} s; PROJECTED on {CPUS} CPUs with "
          f"{len(GPU_KINDS)} GPU kinds: {projected:.1f} s (from the measured task durations; capture excluded)")
    model_name = "Llama-3-8B" + (f" with every dim divided by {scale}" if scale > 1 else "")
    return {"cluster": {"head_cpus": 2, "kind_nodes": {k: 1 for k in GPU_KINDS}},
            "model": f"{model_name} (simulated capture, float32)", "scale": scale,
            "regions": {k: {n: v // scale for n, v in dims.items()} for k, dims, _ in LLAMA3_8B}, "budget_s": budget,
            "measured_wall_s_per_kind_call": dict(zip(GPU_KINDS, walls)), "search_and_driver_s": search_wall,
            "tasks": per_kind, "rows": [r.__dict__ for r in report.rows],
            "projected": {"cpus": CPUS, "gpu_kinds": list(GPU_KINDS), "wall_s": projected,
                          "label": "PROJECTED from measured task durations, not measured; vLLM capture excluded"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--work", type=int, default=1_000_000, help="generation steps per workload (part 1)")
    parser.add_argument("--fleet-budget", type=float, default=20.0, help="search budget per region (part 2)")
    parser.add_argument("--scale", type=int, default=1, help="divide Llama-3-8B's dims by this (part 2)")
    parser.add_argument("--skip-search", action="store_true", help="part 2 only (part 1 kept from --json's file)")
    parser.add_argument("--skip-fleet", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
    out = {"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    if args.skip_search and args.json.is_file():
        out["search"] = json.loads(args.json.read_text()).get("search")
    if not args.skip_search:
        out["search"] = search_check(args.work)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))  # kept should part 2 fail
    if not args.skip_fleet:
        out["fleet"] = fleet_bench(args.fleet_budget, args.scale)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.json}")
    same = all(r["same_hashes"] for r in (out.get("search") or {}).get("workloads", {}).values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
