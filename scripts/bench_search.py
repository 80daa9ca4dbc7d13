"""Benchmark the superoptimizer on the five Prism workloads at their default shapes.

    python scripts/bench_search.py --json FILE [--device h100] [--budget 60] [--workload NAME ...]

For each workload: the time from the Program to verified, instantiated kernels
(search_s, of which verify_s is proofs and numeric checks), the states visited,
the candidates each pruning rule removed, how many designs were verified, and
the modeled time of the best one beside the unfused program's and the
hand-built oracle's, all at the workload's largest default num_tokens. The best plan is
written too: `scripts/gpu_check.py` times it on a GPU beside the oracle (plans are
shape-generic, so it is rebuilt for every shape there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the numeric check runs through the interpreter on CPUs

from prism_serve.optimize.gpus import get_gpu  # noqa: E402
from prism_serve.optimize.search import optimize  # noqa: E402
from prism_serve.optimize.tune import rank  # noqa: E402
from prism_serve.optimize.workloads.oracles import oracle  # noqa: E402
from prism_serve.optimize.workloads.programs import PRISM_WORKLOADS, get_workload  # noqa: E402


def bench(name: str, device: str, budget: float) -> dict:
    w = get_workload(name)
    prog = w.program()
    num_tokens = (w.default_num_tokens or (1,))[-1]
    start = time.perf_counter()
    result = optimize(prog, device, (num_tokens,), budget_s=budget)
    elapsed = time.perf_counter() - start
    s = result.stats
    best = result.found[0].kernels[0] if result.found else None
    return {"num_tokens": num_tokens, "search_s": elapsed, "verify_s": s.verify_s, "states": s.states,
            "plans": s.plans, "pruned": dict(s.pruned), "rejected": dict(s.rejected), "verified": s.verified,
            "stopped_by_budget": s.stopped_by_budget,
            "best_plan": result.found[0].plan.describe() if result.found else None,
            "best_plan_json": result.found[0].plan.to_json() if result.found else None,
            "best_params": best.assignment if best else None,
            "best_modeled_us": best.modeled_us if best else None,
            "unfused_modeled_us": result.unfused_us[num_tokens],
            "oracle_modeled_us": rank(oracle(prog), get_gpu(device), num_tokens)[0].modeled_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--budget", type=float, default=60.0, help="search budget per workload, seconds")
    parser.add_argument("--workload", action="append", help="only these workloads (default: the five Prism ones)")
    args = parser.parse_args(argv)
    names = args.workload or list(PRISM_WORKLOADS)
    results = {}
    head = (f"{'workload':<18} {'tokens':>6} {'search s':>9} {'verify s':>9} {'states':>7} {'pruned':>7} "
            f"{'verified':>8} {'best us':>8} {'oracle us':>9} {'unfused us':>10}  best plan")
    print(head, flush=True)
    print("-" * len(head))
    for name in names:
        r = results[name] = bench(name, args.device, args.budget)
        best = f"{r['best_modeled_us']:.2f}" if r["best_modeled_us"] is not None else "-"
        print(f"{name:<18} {r['num_tokens']:>6} {r['search_s']:>9.1f} {r['verify_s']:>9.1f} {r['states']:>7} "
              f"{sum(r['pruned'].values()):>7} {r['verified']:>8} {best:>8} {r['oracle_modeled_us']:>9.2f} "
              f"{r['unfused_modeled_us']:>10.2f}  {r['best_plan']}", flush=True)
    print("pruned by rule: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in r["pruned"].items())
                                         for n, r in results.items()))
    args.json.write_text(json.dumps({"device": args.device, "budget_s": args.budget, "workloads": results},
                                    indent=1))
    print(f"wrote {args.json}")
    failed = [n for n, r in results.items() if r["best_modeled_us"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
