"""Benchmark the superoptimizer (Prism's operator-by-operator generator, `optimize/generate/`) on
the five Prism workloads at their default shapes, or on any other workload by name: ``rotary`` and
``qk_norm_rotary`` run at Llama-3-8B / Qwen3-8B dims (32 q heads, 8 kv heads, head dim and rotary
dim 128, 8192 positions, bfloat16; `BENCH_DIMS`) over num_tokens buckets 1 to 256, and
``moe_experts`` at Qwen3-30B-A3B's experts (128 experts, top 8, hidden 2048, intermediate 768),
``moe_experts:mixtral`` at Mixtral-8x7B's (8 experts, top 2, hidden 4096, intermediate 14336),
both bfloat16, over 1 to 256 tokens.

    python scripts/bench_search.py --json FILE [--device h100] [--budget 60] [--work STEPS] [--workers N]
        [--workload NAME ...]

For each workload: the time from the Program to verified, instantiated kernels
(search_s, of which verify_s is proofs and numeric checks), the generation work granted and
spent (steps: the budget the results depend on, rather than seconds) and the subtrees it left
open, the kernel graphs and block graphs the generator produced, the candidates each pruning rule removed, the worker
processes (`--workers`, default this machine's cores), the concrete graphs (symbol
assignments) the costed symbolic designs stand for, how many designs were verified, and
the modeled time of the best one (as the search instantiated it, and ranked exhaustively as the
oracle is) beside the unfused program's and the hand-built oracle's, all at the workload's
largest default num_tokens (no oracle for a workload without a hand-built design). The best design is written too (designs are shape-generic JSON:
`scripts/gpu_check.py` rebuilds it for every shape and times it on a GPU beside the oracle).
Timings on a shared, loaded machine are noisy; rerun on a quiet one before quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the numeric check runs through the interpreter on CPUs

from prism_serve.baseline import vllm_modeled_us  # noqa: E402
from prism_serve.errors import SGraphError  # noqa: E402
from prism_serve.optimize.instantiate.tune import rank  # noqa: E402
from prism_serve.optimize.ir.canonical import canonical_hash  # noqa: E402
from prism_serve.optimize.pipeline.search import optimize  # noqa: E402
from prism_serve.optimize.target.gpus import get_gpu  # noqa: E402
from prism_serve.optimize.workloads.oracles import ORACLES, oracle  # noqa: E402
from prism_serve.optimize.workloads.programs import PRISM_WORKLOADS, get_workload  # noqa: E402
from prism_serve.region_table import KINDS  # noqa: E402


# workloads benchmarked at other dims than their defaults, and over several num_tokens buckets
_ROTARY = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "rotary_dim": 128, "max_position": 8192,
           "dtype": "bfloat16"}
_MOE = {"num_experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16"}
_MIXTRAL = {"num_experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336, "dtype": "bfloat16"}
# a case is a workload, or workload:variant at the variant's dims
BENCH_DIMS = {"rotary": _ROTARY, "qk_norm_rotary": _ROTARY, "moe_experts": _MOE, "moe_experts:mixtral": _MIXTRAL}
BENCH_BUCKETS = {name: (1, 16, 64, 256) for name in BENCH_DIMS}


def bench(name: str, device: str, budget: float, work: int | None, workers: int | None, max_block_ops: int) -> dict:
    w = get_workload(name.partition(":")[0])
    if ":" in name and name not in BENCH_DIMS:
        raise SystemExit(f"unknown case {name!r}; the cases with variants are {', '.join(n for n in BENCH_DIMS if ':' in n)}")
    prog = w.program(**BENCH_DIMS.get(name, {}))
    num_tokens = (w.default_num_tokens or (1,))[-1]
    buckets = BENCH_BUCKETS.get(name, (num_tokens,))
    num_tokens = buckets[-1]
    start = time.perf_counter()
    result = optimize(prog, device, buckets, budget_s=budget, work=work, workers=workers,
                      max_block_ops=max_block_ops)
    elapsed = time.perf_counter() - start
    s = result.stats
    best = next(c for c in result.found[0].kernels if c.num_tokens == num_tokens) if result.found else None
    return {"num_tokens": num_tokens, "buckets": list(buckets), "dims": BENCH_DIMS.get(name, {}),
            "search_s": elapsed, "verify_s": s.verify_s,
            "kernel_graphs": s.kernel_graphs, "block_graphs": s.block_graphs, "generated": s.generated,
            "designs": s.designs, "concrete_graphs": s.concrete_graphs, "workers": s.workers,
            "work": s.work, "steps": s.steps, "open_subtrees": s.open_subtrees,
            "pruned": dict(s.pruned), "iterator_maps": s.iterator_maps, "iterator_maps_kept": s.iterator_maps_kept,
            "rejected": dict(s.rejected), "verified": s.verified,
            "stopped_by_budget": s.stopped_by_budget,
            # every verified design's canonical hash, fastest first: what a refactor must leave unchanged
            "verified_hashes": [canonical_hash(f.sgraph) for f in result.found],
            "best_design": result.found[0].design.describe() if result.found else None,
            "best_design_json": result.found[0].design.to_json() if result.found else None,
            "best_params": best.assignment if best else None,
            "best_modeled_us": best.modeled_us if best else None,
            # the winning design ranked exhaustively, like the oracle below (the search instantiates
            # by coordinate descent, `tune.best_modeled`, which can stop at a local optimum)
            "best_ranked_us": rank(result.found[0].sgraph, get_gpu(device), num_tokens)[0].modeled_us
            if result.found else None,
            "unfused_modeled_us": result.unfused_us[num_tokens],
            "unfused_modeled_us_per_bucket": {str(n): result.unfused_us[n] for n in buckets},
            "best_modeled_us_per_bucket": {str(c.num_tokens): c.modeled_us for c in result.found[0].kernels}
            if result.found else None,
            "oracle_modeled_us": _oracle_us(prog, device, num_tokens),
            "oracle_modeled_us_per_bucket": {str(n): _oracle_us(prog, device, n) for n in buckets},
            # what vLLM runs for the region today, priced by the same cost model (the yardstick)
            "vllm_modeled_us_per_bucket": {str(n): vllm_modeled_us(prog, n, get_gpu(device)) for n in buckets}
            if prog.name in KINDS else None}


def _oracle_us(prog, device: str, num_tokens: int) -> float | None:
    """The hand-built design's best modeled time, or None: no hand-built design, or none of its
    instances fits the device (Mixtral's 14336-wide experts rows in the MoE oracle's w2 tile)."""
    if prog.name not in ORACLES:
        return None
    try:
        return rank(oracle(prog), get_gpu(device), num_tokens)[0].modeled_us
    except SGraphError:
        return None


def _us(per_bucket: dict | None, n: int) -> str:
    value = (per_bucket or {}).get(str(n))
    return f"{value:.2f}" if value is not None else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--budget", type=float, default=60.0, help="search budget per workload, seconds")
    parser.add_argument("--work", type=int, help="generation steps per workload (default: per second of --budget)")
    parser.add_argument("--workers", type=int, help="worker processes (default: this machine's cores)")
    parser.add_argument("--max-block-ops", type=int, default=8, help="most block ops per graph-defined kernel")
    parser.add_argument("--workload", action="append", help="only these workloads (default: the five Prism ones)")
    args = parser.parse_args(argv)
    names = args.workload or list(PRISM_WORKLOADS)
    results = {}
    head = (f"{'workload':<21} {'tokens':>6} {'search s':>9} {'verify s':>9} {'kernels':>7} {'blocks':>7} "
            f"{'steps':>9} {'open':>4} {'pruned':>8} {'abs %':>5} {'workers':>7} {'verified':>8} {'best us':>8} {'ranked us':>9} {'oracle us':>9} "
            f"{'unfused us':>10}  best design")
    print(head, flush=True)
    print("-" * len(head))
    for name in names:
        r = results[name] = bench(name, args.device, args.budget, args.work, args.workers, args.max_block_ops)
        best = f"{r['best_modeled_us']:.2f}" if r["best_modeled_us"] is not None else "-"
        ranked = f"{r['best_ranked_us']:.2f}" if r["best_ranked_us"] is not None else "-"
        hand = f"{r['oracle_modeled_us']:.2f}" if r["oracle_modeled_us"] is not None else "-"
        pruned = sum(r["pruned"].values())
        share = 100.0 * r["pruned"]["abstract_expression"] / pruned if pruned else 0.0
        print(f"{name:<21} {r['num_tokens']:>6} {r['search_s']:>9.1f} {r['verify_s']:>9.1f} {r['kernel_graphs']:>7} "
              f"{r['block_graphs']:>7} {r['steps']:>9} {r['open_subtrees']:>4} {pruned:>8} {share:>5.1f} {r['workers']:>7} {r['verified']:>8} {best:>8} {ranked:>9} "
              f"{hand:>9} {r['unfused_modeled_us']:>10.2f}  {r['best_design']}", flush=True)
    for name, r in results.items():
        if len(r["buckets"]) > 1:
            print(f"{name} per bucket (modeled us): " + "; ".join(
                f"T {n}: best {_us(r['best_modeled_us_per_bucket'], n)}, oracle {_us(r['oracle_modeled_us_per_bucket'], n)}, "
                f"vLLM {_us(r['vllm_modeled_us_per_bucket'], n)}" for n in r["buckets"]))
    print("pruned by rule: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in r["pruned"].items())
                                         for n, r in results.items()))
    print("input iterator maps judged (kept): " + "; ".join(f"{n}: {r['iterator_maps']} ({r['iterator_maps_kept']})"
                                                             for n, r in results.items()))
    args.json.write_text(json.dumps({"device": args.device, "budget_s": args.budget, "max_block_ops": args.max_block_ops,
                                     "workers": next(iter(results.values()))["workers"],
                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "workloads": results}, indent=1))
    print(f"wrote {args.json}")
    failed = [n for n, r in results.items() if r["best_modeled_us"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
