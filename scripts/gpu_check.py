"""GPU check: instantiate every workload's kernel through the tuner, prove it correct, time it.

For each workload, shape and dtype: rank the oracle sGraph's instances with the cost model,
time the top candidates on the device, keep the measured winner, check it against the torch
reference on fresh NaN-poisoned outputs, and time it against torch eager and torch.compile
of the same Program (compiled once per workload, shape and dtype with num_tokens dynamic, as
vLLM compiles its graph). On a GPU every time is device time under CUDA-graph replay, as vLLM
decodes (`timing.graph_us`; the winner's time on a plain stream, host launches included, is
kept beside it), and the device's own bandwidth and launch latencies are probed first
(`devbench`) so the winner is also priced with the measured spec. Cases run all workloads in
the first dtype before the next dtype, and the JSON and table are rewritten after every case,
so a run cut short by its budget or its caller keeps what it measured.

For every region kind of the region table it also times vLLM's path for the region
(`prism_serve.baseline`: vLLM's own ops where vLLM is installed, else eager torch, named so)
beside the cost model's price of that path, so one run gives the model's error on vLLM's path
(Spearman and median measured/modeled ratio per region; where vLLM is absent, also against
torch.compile of the region as a named stand-in), and what the plugin would run (the kernel,
plus the residual add beside rmsnorm_swiglu's) against it. The superoptimizer's own best design
for each workload it found one for (the Prism workloads, rotary, the MoE experts; read from the newest bench/results/search-*.json that
scripts/bench_search.py wrote, proven there) is rebuilt for each shape and checked and timed the
same way, in the first dtype, as design "searched". Writes gpu_check.json and gpu_check.md
under --out and prints the table.

--interpret runs the same path on the CPU through Triton's interpreter at tiny shapes, so the
script is proven before any device time is spent (its times say nothing about GPU speed).
Needs only torch, triton, sympy and numpy (no egglog): it runs from a checkout with PYTHONPATH=.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INTERPRET = "--interpret" in sys.argv
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402

from prism_serve.baseline import baseline, served, served_modeled_us, vllm_modeled_us  # noqa: E402
from prism_serve.optimize.codegen.render import compile_instance  # noqa: E402
from prism_serve.optimize.generate.design import Design, build  # noqa: E402
from prism_serve.optimize.instantiate.cost import unfused_us  # noqa: E402
from prism_serve.optimize.instantiate.cost import modeled_us  # noqa: E402
from prism_serve.optimize.instantiate.timing import graph_us, median_us, rotation, spearman  # noqa: E402
from prism_serve.optimize.instantiate.tune import measure, rank  # noqa: E402
from prism_serve.optimize.ir.program import NUM_TOKENS  # noqa: E402
from prism_serve.optimize.ir.reference import (TOLERANCE, TORCH_DTYPES, as_torch_function, evaluate,  # noqa: E402
                                               max_rel_error, random_inputs)
from prism_serve.optimize.target.gpus import get_gpu  # noqa: E402
from prism_serve.optimize.workloads.oracles import oracle  # noqa: E402
from prism_serve.optimize.workloads.programs import WORKLOADS  # noqa: E402
from prism_serve.region_table import KINDS  # noqa: E402

CHECK_SEED = 1 << 20  # correctness inputs' seeds start here, past any timing set's (`rotation`)
GPU_PLAN = {  # workload -> (list of dims, num_tokens list); attention shapes carry their own sizes
    **{w: ([{}], [1, 16, 256, 4096]) for w in ("rms_norm", "fused_add_rms_norm", "silu_and_mul")},
    **{w: ([{}], [1, 16, 256, 4096]) for w in ("rmsnorm_linear", "swiglu", "rmsnorm_mlp", "fused_add_rmsnorm_linear",
                                               "rmsnorm_swiglu", "fused_add_rmsnorm_linear_bias")},
    **{w: (list(WORKLOADS[w].shapes), [0]) for w in ("attention", "qk_norm_attention")},
    **{w: ([{}], [1, 16, 256, 4096]) for w in ("rotary", "qk_norm_rotary")},
    # Qwen3-30B-A3B's experts (Mixtral's fit no design yet); vLLM's fused MoE is the baseline
    "moe_experts": ([{"num_experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}], [1, 16, 256]),
}
INTERPRET_PLAN = {  # tiny, awkward sizes: 1 token, non-power-of-two hidden sizes
    "rms_norm": ([{"hidden": 96}], [1, 5]), "fused_add_rms_norm": ([{"hidden": 96}], [5]),
    "silu_and_mul": ([{"intermediate": 48}], [3]),
    "rmsnorm_linear": ([{"hidden": 64, "out": 32}], [1]), "swiglu": ([{"hidden": 64, "intermediate": 32}], [5]),
    "rmsnorm_mlp": ([{"hidden": 64, "intermediate": 32}], [5]),
    "fused_add_rmsnorm_linear": ([{"hidden": 64, "out": 32}], [3]),
    "fused_add_rmsnorm_linear_bias": ([{"hidden": 64, "out": 48}], [1]),
    "rmsnorm_swiglu": ([{"hidden": 64, "intermediate": 32}], [1]),
    "attention": ([dict(batch=1, heads=2, q_len=1, kv_len=48, head_dim=16)], [0]),
    "qk_norm_attention": ([dict(batch=1, heads=2, q_len=1, kv_len=48, head_dim=16)], [0]),
    # the searched rotary designs hold their slices' bounds as numbers: they rebuild at head_dim 128 only
    "rotary": ([dict(num_q_heads=3, num_kv_heads=1, head_dim=128, max_position=40)], [1, 5]),
    "qk_norm_rotary": ([dict(num_q_heads=3, num_kv_heads=1, head_dim=128, max_position=40)], [5]),
    # vLLM's CPU fused MoE takes hidden and intermediate sizes in multiples of 32
    "moe_experts": ([dict(num_experts=3, top_k=2, hidden=32, intermediate=32)], [1]),
}


def device_spec():
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100", "l40s"):
            if key in name:
                return get_gpu(key), torch.cuda.get_device_name()
        return get_gpu("h100"), torch.cuda.get_device_name() + " (modeled as h100)"
    return get_gpu("h100"), "CPU (Triton interpreter; modeled as h100)"


def probe_device(spec):
    """The spec built from this GPU's measured bandwidth and launch latencies (None where the
    probe failed), and what to record of it beside the table's spec."""
    from prism_serve.optimize.instantiate.devbench import measured_spec
    try:
        measured = measured_spec()
    except Exception as exc:  # a probe failure is a finding; the table's spec still prices every case
        return None, {"error": f"{type(exc).__name__}: {exc}"[:300], "table_spec": spec.to_json()}
    return measured, {"measured_spec": measured.to_json(), "table_spec": spec.to_json()}


def time_us(fn, sets, args) -> float:
    """Microseconds per call: CUDA-graph replay on a GPU (a failed capture is recorded and the
    stream timing used instead), the interpreter's wall time on the CPU."""
    if args.graphs:
        try:
            return graph_us(fn, sets, warmup=max(args.warmup, 1), reps=args.graph_reps)
        except Exception as exc:  # noqa: BLE001 - recorded in the result's graph_failures
            args.graph_failures.append(f"{type(exc).__name__}: {exc}"[:200])
            torch.cuda.synchronize()
    return median_us(fn, sets, warmup=args.warmup, reps=args.reps)


_COMPILED: dict[tuple, object] = {}


def lift_recompile_limits() -> None:
    """Every Program's torch function shares one code object, where Dynamo counts recompiles:
    lift its limits, and fail loudly rather than fall back to eager past them."""
    cfg = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, limit):
            setattr(cfg, limit, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def compiled_us(prog, dims, sets, args) -> float:
    """torch.compile of the Program, built once per workload, shape and dtype, with the token dim
    of every input marked dynamic (vLLM compiles its graph once for all num_tokens)."""
    key = (prog.name, json.dumps(dims, sort_keys=True), prog.inputs[0].attr("dtype"))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(as_torch_function(prog))
    token_dims = [n.attr("shape").index(NUM_TOKENS) if NUM_TOKENS in n.attr("shape") else None for n in prog.inputs]
    for s in sets:
        for t, d in zip(s, token_dims):
            if d is not None:
                torch._dynamo.maybe_mark_dynamic(t, d)
    return time_us(_COMPILED[key], sets, args)


def searched_designs(path: Path | None, results: Path = ROOT / "bench" / "results") -> dict[str, Design]:
    """workload -> the search's best design, from a bench_search JSON or by default from the newest
    one under `results` holding that workload (a bench run may cover some workloads only). Newest by
    the time bench_search wrote into it; runs from before it wrote one are older, in name order."""
    runs = [json.loads(p.read_text()) for p in ([path] if path is not None else sorted(results.glob("search-*.json")))]
    designs = {}
    for data in sorted(runs, key=lambda d: str(d.get("finished", ""))):  # stable: oldest first, replaced by newer
        designs |= {name: r["best_design_json"] for name, r in data["workloads"].items() if r.get("best_design_json")}
    return {name: Design.from_json(d) for name, d in designs.items()}


def check_case(name, dims, num_tokens, dtype, spec, device, args, deadline, design: Design | None = None):
    prog = WORKLOADS[name].program(**dims, dtype=dtype)
    ranked = rank(oracle(prog) if design is None else build(prog, design), spec, num_tokens)
    nbytes = sum(t.numel() * t.element_size() for t in random_inputs(prog, num_tokens, seed=0))
    sets = rotation(lambda s: random_inputs(prog, num_tokens, seed=s, device=device), nbytes,
                    int(spec.l2_mb * 2**20), max_sets=args.max_sets)
    reps = args.reps

    def timer(inst, n):
        return time_us(compile_instance(inst), sets, args)

    timed = measure(ranked, timer, top=args.top)
    row = {"workload": name, "dims": dims, "num_tokens": num_tokens, "dtype": dtype,
           "design": "oracle" if design is None else "searched",
           "describe": "hand-built" if design is None else design.describe(),
           "candidates": [{"assignment": c.assignment, "modeled_us": c.modeled_us, "measured_us": c.measured_us}
                          for c in timed],
           "unfused_modeled_us": unfused_us(prog, num_tokens, spec)}
    if not timed:
        row["error"] = "every candidate failed to compile or run"
        return row
    best = timed[0]
    row |= {"assignment": best.assignment, "modeled_us": best.modeled_us, "measured_us": best.measured_us,
            "rank_correlation": spearman([c.modeled_us for c in timed], [c.measured_us for c in timed])}
    # correctness on fresh inputs (none of the timing sets), outputs poisoned so unwritten elements show
    # as NaN; seeded by the Program, so that every run checks the same inputs: unseeded, they followed the
    # global generator's state after timing, and a bf16 qk_norm_attention error of 0.008-0.018 (both the
    # oracle and the searched design; tolerance 0.016) passed or failed from run to run
    run = compile_instance(best.instance)
    inputs = random_inputs(prog, num_tokens, seed=CHECK_SEED + int(prog.canonical_hash[:6], 16), device=device)
    ref = evaluate(prog, [t.cpu() for t in inputs])
    outs = [torch.full(r.shape, float("nan"), dtype=TORCH_DTYPES[dtype], device=device) for r in ref]
    run(*inputs, out=outs)
    errors = [max_rel_error(o, r) for o, r in zip(outs, ref)]
    row["max_rel_error"] = max(errors)
    row["correct"] = all(e < TOLERANCE[dtype] for e in errors) and not any(torch.isnan(o).any() for o in outs)
    eager = as_torch_function(prog)
    if args.graphs:  # the same kernel launched on a plain stream: host launch cost included
        row["measured_stream_us"] = median_us(run, sets, warmup=args.warmup, reps=reps)
    if args.probed_spec is not None:
        row["modeled_us_probed_spec"] = modeled_us(best.instance, num_tokens, args.probed_spec)
    row["eager_us"] = time_us(eager, sets, args)
    if prog.name in KINDS:
        row |= vllm_path(prog, run, best, num_tokens, spec, sets, args)
    if args.compile and time.monotonic() < deadline:
        try:
            row["compile_us"] = compiled_us(prog, dims, sets, args)
        except Exception as exc:  # an inductor failure is a finding to record, not a crash
            row["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        row["compile_skipped"] = "time budget" if args.compile else "disabled"
    return row


def vllm_path(prog, kernel, best, num_tokens, spec, sets, args) -> dict:
    """vLLM's path for the region, timed and modeled, and what the plugin runs for it, timed and modeled."""
    base = baseline(prog)
    prepare, run = served(prog, kernel)
    row = {"baseline": base.name, "vllm_modeled_us": vllm_modeled_us(prog, num_tokens, spec),
           "served_modeled_us": served_modeled_us(prog, best.modeled_us, num_tokens, spec),
           "served_us": time_us(run, [prepare(s) for s in sets], args)}
    try:
        row["baseline_us"] = time_us(base.run, [base.prepare(s) for s in sets], args)
    except Exception as exc:  # vLLM's op may not take this dtype here: a finding, not a crash
        row["baseline_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


STAND_IN = "torch.compile of the region (norms and activations as inductor kernels, projections as cuBLAS)"


def _fit(rows, measured_key) -> dict:
    ratios = sorted(r[measured_key] / r["vllm_modeled_us"] for r in rows)
    return {"cases": len(rows), "spearman": spearman([r["vllm_modeled_us"] for r in rows],
                                                     [r[measured_key] for r in rows]),
            "median_measured_over_modeled": ratios[len(ratios) // 2] if ratios else None}


def vllm_path_model(rows) -> dict:
    """Per region kind: how well the cost model prices vLLM's path, over the cases timed against
    vLLM itself; where vLLM is absent, against the stand-in that runs vLLM's kernel structure."""
    out = {}
    for kind in sorted({r["workload"] for r in rows if "vllm_modeled_us" in r}):
        mine = [r for r in rows if r["workload"] == kind]
        out[kind] = _fit([r for r in mine if "baseline_us" in r and r.get("baseline") == "vllm"], "baseline_us")
        if not out[kind]["cases"]:
            out[kind]["why_none"] = "vLLM is not installed here: its path was not timed"
            out[kind]["stand_in"] = STAND_IN
            out[kind]["against_stand_in"] = _fit([r for r in mine if "compile_us" in r], "compile_us")
    return out


def run_case(name, dims, n, dtype, spec, device, args, deadline, design, start) -> dict:
    t0 = time.monotonic()
    try:
        row = check_case(name, dims, n, dtype, spec, device, args, deadline, design)
    except Exception as exc:  # record and go on: one broken case must not lose the run
        row = {"workload": name, "dims": dims, "num_tokens": n, "dtype": dtype,
               "design": "oracle" if design is None else "searched", "error": f"{type(exc).__name__}: {exc}"[:300]}
    row["case_s"] = round(time.monotonic() - t0, 2)
    print(f"[{time.monotonic() - start:6.1f}s] {name} {row['design']} {dims} n={n} {dtype}: "
          f"{row.get('measured_us', row.get('error'))}", flush=True)
    return row


def markdown(rows, device_name):
    lines = [f"GPU check on {device_name}", "",
             "| workload | design | shape | tokens | dtype | kernel | modeled us | measured us | eager us |"
             " compile us | vs eager | vs compile | vLLM path modeled us | vLLM path us | served us |"
             " vs vLLM measured | rel err | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "measured_us" not in r:
            lines.append(f"| {r['workload']} | {r.get('design', '?')} | {r['dims']} | {r['num_tokens']} | "
                         f"{r['dtype']} | {r.get('error', '?')} | | | | | | | | | | | | no |")
            continue
        comp, measured = r.get("compile_us"), r["measured_us"]
        shape = ",".join(f"{k}={v}" for k, v in r["dims"].items()) or "default"
        kernel = ",".join(f"{k}={v}" for k, v in r["assignment"].items())
        comp_us = f"{comp:.1f}" if comp else "-"
        vs_comp = f"{comp / measured:.2f}x" if comp else "-"
        stream = f" (stream {r['measured_stream_us']:.1f})" if "measured_stream_us" in r else ""
        lines.append(
            f"| {r['workload']} | {r['design']} | {shape} | {r['num_tokens'] or '-'} | {r['dtype']} | {kernel} | "
            f"{r['modeled_us']:.1f} | {measured:.1f}{stream} | {r['eager_us']:.1f} | {comp_us} | "
            f"{r['eager_us'] / measured:.2f}x | {vs_comp} | {_vllm_cells(r)} | {r['max_rel_error']:.1e} | "
            f"{'yes' if r['correct'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _vllm_cells(r) -> str:
    if "vllm_modeled_us" not in r:
        return "- | - | - | -"
    base = r.get("baseline_us")
    named = "" if r["baseline"] == "vllm" else f" ({r['baseline']})"
    return (f"{r['vllm_modeled_us']:.1f} | " + (f"{base:.1f}{named}" if base else r.get("baseline_error", "-")[:40])
            + f" | {r['served_us']:.1f} | " + (f"{base / r['served_us']:.2f}x{named}" if base else "-"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret", action="store_true", help="CPU through Triton's interpreter, tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for gpu_check.json / .md")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this long")
    ap.add_argument("--top", type=int, default=None, help="candidates timed per case")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--max-sets", type=int, default=None, help="input sets rotated while timing")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    ap.add_argument("--workloads", nargs="*", default=None)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    ap.add_argument("--designs", type=Path, default=None,
                    help="bench_search JSON with the searched designs (default: newest bench/results/search-*.json)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="time on a plain stream (host launches included) instead of CUDA-graph replay")
    args = ap.parse_args(argv)
    tiny = args.interpret
    # The interpreter runs each block in Python: one timed run of the top candidate proves the path.
    defaults = {"top": (1, 4), "reps": (1, 100), "warmup": (0, 10), "max_sets": (2, 16)}
    for key, (interpreted, gpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, interpreted if tiny else gpu)
    plan = INTERPRET_PLAN if tiny else GPU_PLAN
    args.compile_only = {"rms_norm"} if tiny else set(plan)  # inductor on the CPU takes ~10 s a graph
    if args.compile:
        lift_recompile_limits()
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    args.graphs = args.graphs and device == "cuda"
    args.graph_reps, args.graph_failures = 20, []
    spec, device_name = device_spec()
    start = time.monotonic()
    args.probed_spec, probe = probe_device(spec) if device == "cuda" else (None, {"skipped": "not on a GPU"})
    print(f"[{time.monotonic() - start:6.1f}s] device probe: {probe}", flush=True)
    deadline = start + args.budget_s
    meta = {"device": device_name, "modeled_as": spec.name, "interpret": tiny,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "timing": "cuda-graph replay (device time per call)" if args.graphs else
            ("stream events" if device == "cuda" else "interpreter wall time"), "device_probe": probe}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    searched = searched_designs(args.designs)
    for dtype in args.dtypes:  # every workload in the first dtype before the next dtype
        for name in args.workloads or plan:
            dims_list, tokens = plan[name]
            designs = [None] + ([searched[name]] if name in searched and dtype == args.dtypes[0] else [])
            for dims in dims_list:
                for n in tokens:
                    for design in designs:
                        if time.monotonic() > deadline:
                            skipped.append({"workload": name, "dims": dims, "num_tokens": n, "dtype": dtype,
                                            "design": "oracle" if design is None else "searched"})
                            continue
                        use_compile = args.compile and name in args.compile_only
                        case_args = argparse.Namespace(**(vars(args) | {"compile": use_compile}))
                        rows.append(run_case(name, dims, n, dtype, spec, device, case_args, deadline, design, start))
                        report(rows, skipped, meta, args, start, out, final=False)
    result, table = report(rows, skipped, meta, args, start, out, final=True)
    print(table)
    return 0 if result["all_correct"] and not skipped else 1


def report(rows, skipped, meta, args, start, out: Path, *, final: bool):
    """Write gpu_check.json and gpu_check.md for the cases so far (`final`: the run is complete)."""
    winners = [r for r in rows if "measured_us" in r]
    result = meta | {
        "complete": final, "wall_s": round(time.monotonic() - start, 1), "cases": rows, "skipped": skipped,
        "graph_failures": args.graph_failures,
        "all_correct": bool(winners) and all(r["correct"] for r in winners) and len(winners) == len(rows),
        "rank_correlation_winners": spearman([r["modeled_us"] for r in winners], [r["measured_us"] for r in winners]),
        "vllm_path_model": vllm_path_model(rows),
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(rows, meta["device"] + f" ({meta['timing']})")
    table += (f"\nmodeled-vs-measured rank correlation over winners: {result['rank_correlation_winners']}; "
              f"all correct: {result['all_correct']}; {len(skipped)} cases skipped for time; "
              f"wall {result['wall_s']} s" + ("" if final else " (run in progress)") + "\n")
    for kind, m in result["vllm_path_model"].items():
        table += (f"vLLM's path for {kind}: {m['cases']} cases timed against vLLM, Spearman {m['spearman']}, "
                  f"median measured/modeled {m['median_measured_over_modeled']}")
        if "why_none" in m:
            s = m["against_stand_in"]
            table += (f" ({m['why_none']}; against the stand-in, {m['stand_in']}: {s['cases']} cases, "
                      f"Spearman {s['spearman']}, median measured/modeled {s['median_measured_over_modeled']})")
        table += "\n"
    (out / "gpu_check.md").write_text(table)
    return result, table


if __name__ == "__main__":
    sys.exit(main())
