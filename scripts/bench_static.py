"""Static GPU facts of the kernels warmup would store, without a GPU.

For the five Prism workloads (H100 shapes, fp16) and the embedded models' regions (their
config's sizes, in bf16 as a GPU serves them), at every power-of-two bucket from 1 to 256
tokens: the cost model's best instance of the hand-built design (what the tuner stores for
it), compiled by Triton for sm_90 and sm_80 on this machine. Prints, per kernel, ptxas's
registers, spill (stack) bytes, shared memory and tensor-core instruction counts beside the
resource model's own estimate, and the checks of issue 13's targets:
  - no instance chosen for 1-16 tokens spills (stack and local bytes 0): the model's pick, and
    where that spills, the instance warmup stores after ptxas's check (`tune.screen`);
  - every kernel the model says emits tl.dot has tensor-core instructions (HGMMA / HMMA);
  - the register estimate is within 25 % of ptxas's (registers + stack / 4 where it spills).

With --fit SAMPLE it compiles nothing: it refits the register model's weights (resources.REG_WEIGHTS)
by non-negative least squares on relative error over a sample of ptxas facts (one JSON object a
line: source, sm, kernel, assignment, warps, mma_padded, ptxas_regs, stack_bytes, chosen), kernels
a bench run chose weighed CHOSEN_WEIGHT x, spilling kernels left out, accumulators and addresses at
their physical weights; it prints the weights and the share within the tolerance.

With --tf32-pairs FILE it compiles the fp16 rmsnorm_linear and rmsnorm_mlp oracles at their best and
random instances per bucket, each as built and on TF32 operands (`designs.on_tf32`), and writes the
pairs' ptxas registers (one JSON object a line); it prints the median of (TF32 - half registers) over
the `tf32_operands` term, the weight that term carries (`resources.REG_WEIGHTS`).

Usage: PYTHONPATH=. python scripts/bench_static.py [--json FILE] [--quick] [--fit SAMPLE] [--tf32-pairs FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prism_serve.capture.embedded import EMBEDDED, embedded_path  # noqa: E402
from prism_serve.errors import SGraphError  # noqa: E402
from prism_serve.optimize.instantiate.static import compile_facts, compiler_versions  # noqa: E402
from prism_serve.optimize.instantiate.tune import enumerate_instances, rank, screen  # noqa: E402
from prism_serve.optimize.ir.sgraph import BlockKernel  # noqa: E402
from prism_serve.optimize.target.gpus import get_gpu  # noqa: E402
from prism_serve.optimize.target.instance import instantiate  # noqa: E402
from prism_serve.optimize.workloads.designs import on_tf32  # noqa: E402
from prism_serve.optimize.workloads.oracles import oracle  # noqa: E402
from prism_serve.optimize.workloads.programs import PRISM_WORKLOADS, WORKLOADS  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TARGETS = {90: "h100", 80: "a100"}  # the GPU spec each target's instances are chosen for
DECODE_MAX = 16  # the no-spill target covers instances chosen for 1-16 tokens
REG_TOLERANCE = 0.25
CHOSEN_WEIGHT = 3.0  # the kernels the tuner stores matter most
PHYSICAL = {"dot_accumulators": 1.0, "accumulators": 1.0, "addresses": 2.0}  # registers per unit, not fitted
# fitted apart, on pairs of the same kernel compiled with half and TF32 operands (resources.py)
APART = ("tf32_operands",)


def embedded_programs(name: str, dtype: str = "bfloat16") -> dict[str, object]:
    """The region Programs of an embedded model, at its config's sizes."""
    cfg = json.loads((embedded_path(name) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    eps = cfg.get("rms_norm_eps", 1e-6)
    w = WORKLOADS
    return {
        "rms_norm": w["rms_norm"].program(hidden=hidden, dtype=dtype, eps=eps),
        "fused_add_rms_norm": w["fused_add_rms_norm"].program(hidden=hidden, dtype=dtype, eps=eps),
        "silu_and_mul": w["silu_and_mul"].program(intermediate=inter, dtype=dtype),
        "rmsnorm_linear": w["rmsnorm_linear"].program(hidden=hidden, out=qkv, dtype=dtype, eps=eps),
        "fused_add_rmsnorm_linear": w["fused_add_rmsnorm_linear"].program(hidden=hidden, out=qkv, dtype=dtype,
                                                                          eps=eps),
        "rmsnorm_swiglu": w["rmsnorm_swiglu"].program(hidden=hidden, intermediate=inter, dtype=dtype, eps=eps),
    }


def cases(quick: bool) -> list[tuple[str, object, tuple[int, ...]]]:
    """(source, program, buckets): the five workloads, then every embedded model's regions."""
    buckets = (1, 16) if quick else BUCKETS
    out = []
    for name in PRISM_WORKLOADS:
        prog = WORKLOADS[name].program()
        tokens = any("num_tokens" in n.attr("shape") for n in prog.inputs)
        out.append((f"workload {name}", prog, buckets if tokens else (0,)))
    for model in EMBEDDED[:1] if quick else EMBEDDED:
        for kind, prog in embedded_programs(model).items():
            out.append((f"{model} {kind}", prog, buckets))
    return out


def model_row(inst, k) -> dict:
    r = inst.resources(k)
    return {"model_regs": r.regs_per_thread, "model_smem": r.smem, "warps": r.warps, "model_dots": len(r.dots),
            "mma_padded": r.mma_padded}


def _nnls(a, b, rounds: int = 500):
    """min |a x - b| over x >= 0 (Lawson and Hanson's active-set method)."""
    import numpy as np
    active = np.zeros(a.shape[1], bool)
    x = np.zeros(a.shape[1])
    for _ in range(rounds):
        grad = a.T @ (b - a @ x)
        if active.all() or (grad[~active] <= 1e-10).all():
            break
        active[np.argmax(np.where(active, -np.inf, grad))] = True
        while True:
            z = np.zeros_like(x)
            z[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if (z[active] > 0).all():
                x = z
                break
            neg = active & (z <= 0)
            x = x + np.min(x[neg] / (x[neg] - z[neg])) * (z - x)
            active &= x > 1e-12
    return x


def fit(sample: Path) -> int:
    """Refit REG_WEIGHTS on `sample` (see the module doc) and print them with the fit's errors."""
    import numpy as np

    from prism_serve.optimize.target.resources import REG_WEIGHTS, _resources
    programs = {source: prog for source, prog, _ in cases(False)}
    graphs: dict = {}
    rows = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not r["stack_bytes"]]
    terms = []
    for r in rows:
        g = graphs.setdefault(r["source"], oracle(programs[r["source"]]))
        k = next(k for k in g.kernels if isinstance(k, BlockKernel) and k.name == r["kernel"])
        terms.append(_resources(g, k, r["assignment"], r["mma_padded"]).demand.terms(r["warps"]))
    kept = PHYSICAL | {n: REG_WEIGHTS[n] for n in APART}
    free = [n for n in REG_WEIGHTS if n not in kept]
    x = np.array([[t[n] for n in free] for t in terms])
    fixed = np.array([sum(w * t[n] for n, w in kept.items()) for t in terms])
    y = np.array([r["ptxas_regs"] for r in rows], float)
    scale = np.where([r["chosen"] for r in rows], CHOSEN_WEIGHT, 1.0) / y
    chosen = np.array([r["chosen"] for r in rows])
    weights = dict(zip(free, _nnls(x * scale[:, None], (y - fixed) * scale))) | kept
    print("fitted:", {n: round(float(weights[n]), 2) for n in REG_WEIGHTS})
    for label, w in (("fitted", weights), ("in use", REG_WEIGHTS)):
        est = np.ceil([sum(w[n] * t[n] for n in REG_WEIGHTS) for t in terms])
        err = np.abs(est - y) / y
        for part, mask in (("sample", ~chosen), ("chosen", chosen)):
            print(f"{label:7} {part}: {mask.sum()} kernels, |error| median {np.median(err[mask]):.0%}, "
                  f"within {REG_TOLERANCE:.0%}: {(err[mask] <= REG_TOLERANCE).sum()}")
    return 0


def tf32_pairs(out: Path) -> int:
    """Compile kernel pairs, as built and on TF32 operands, and write their registers (module doc)."""
    from prism_serve.optimize.target.resources import kernel_resources
    rng = random.Random(0)
    jobs, meta = [], []
    for name in ("rmsnorm_linear", "rmsnorm_mlp"):
        g = oracle(WORKLOADS[name].program())
        twin = on_tf32(g)
        for cc, gpu_name in TARGETS.items():
            gpu = get_gpu(gpu_name)
            instances = enumerate_instances(g, gpu)
            picked = {}
            for nt in BUCKETS:
                ranked = rank(g, gpu, nt, instances)
                for c in ranked[:3] + rng.sample(ranked, min(3, len(ranked))):
                    if c.instance.resources(g.kernels[0]).dots:
                        picked[c.instance.assignment] = c.instance
            for inst in picked.values():
                try:
                    other = instantiate(twin, inst.values, gpu)
                except SGraphError:  # the model says the TF32 form would spill at any warps
                    continue
                if other.warps(twin.kernels[0]) == inst.warps(g.kernels[0]):  # compared at equal warps
                    jobs += [(inst, cc), (other, cc)]
                    meta.append((f"workload {name}", cc, other))
    print(f"compiling {len(jobs)} kernels ...", file=sys.stderr, flush=True)
    facts = compile_facts(jobs)
    ratios = []
    with out.open("w") as f:
        for j, (source, cc, inst) in enumerate(meta):
            (half,), (tf32,) = facts[2 * j], facts[2 * j + 1]
            k = inst.sgraph.kernels[0]
            term = kernel_resources(inst.sgraph, k, inst.values).demand.terms(tf32.num_warps)["tf32_operands"]
            if not (half.spills or tf32.spills) and term:
                ratios.append((tf32.registers - half.registers) / term)
            f.write(json.dumps({"source": source, "sm": cc, "assignment": inst.values, "warps": tf32.num_warps,
                                "half": [half.registers, half.stack_bytes], "tf32": [tf32.registers, tf32.stack_bytes],
                                "term": term}) + "\n")
    print(f"{len(meta)} pairs, {len(ratios)} without spills: (TF32 - half registers) / tf32_operands term, "
          f"median {statistics.median(ratios):.3f}, range {min(ratios):.2f} to {max(ratios):.2f}")
    return 0


def screened_spills(spilled: list[dict], programs: dict) -> list[dict]:
    """Of the spilling model picks at 1-16 tokens, those still spilling after `tune.screen`
    (what warmup stores on a GPU), each row naming the instance screened in; all cases' rankings
    are screened in one call (one or two child processes)."""
    cases, seen = [], set()
    for r in spilled:
        key = (r["sm"], r["sgraph"], json.dumps(r["assignment"], sort_keys=True), tuple(r["sources"]))
        if key in seen:  # another block kernel of the same instance
            continue
        seen.add(key)
        gpu = get_gpu(TARGETS[r["sm"]])
        for source in r["sources"]:
            g = oracle(programs[source])
            instances = enumerate_instances(g, gpu)
            cases += [(r, source, nt, rank(g, gpu, nt, instances)) for nt in r["buckets"] if nt <= DECODE_MAX]
    out = []
    for sm in sorted({r["sm"] for r, *_ in cases}):
        here = [c for c in cases if c[0]["sm"] == sm]
        for (r, source, nt, _), (taken, *_) in zip(here, screen([ranking for *_, ranking in here], sm)):
            stack = "not compiled" if taken.facts is None else [f.stack_bytes for f in taken.facts]
            print(f"screen: sm_{sm} {source} at {nt} tokens: {r['assignment']} spills, "
                  f"{taken.assignment} taken (stack bytes: {stack})", file=sys.stderr)
            if taken.facts is None or any(f.spills for f in taken.facts):
                out.append(r | {"screened": taken.assignment})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows and the checks here")
    ap.add_argument("--quick", action="store_true", help="buckets 1 and 16, one embedded model")
    ap.add_argument("--fit", type=Path, help="refit the register weights on this sample of ptxas facts")
    ap.add_argument("--tf32-pairs", type=Path, help="write registers of kernels compiled half and TF32 here")
    args = ap.parse_args()
    if args.fit:
        return fit(args.fit)
    if args.tf32_pairs:
        return tf32_pairs(args.tf32_pairs)
    chosen = {}  # (cc, sgraph name, program hash, assignment) -> (instance, sources)
    for source, prog, buckets in cases(args.quick):
        g = oracle(prog)
        for cc, gpu in TARGETS.items():
            instances = enumerate_instances(g, get_gpu(gpu))
            for nt in buckets:
                inst = rank(g, get_gpu(gpu), nt, instances)[0].instance
                key = (cc, g.name, prog.canonical_hash, inst.assignment)
                chosen.setdefault(key, (inst, []))[1].append((source, nt))
    keys = list(chosen)
    compiler = compiler_versions()
    print(f"compiling {len(keys)} instances with Triton {compiler['triton']}, ptxas {compiler['ptxas']} ...",
          file=sys.stderr, flush=True)
    facts = compile_facts([(chosen[k][0], k[0]) for k in keys])
    rows = []
    for key, kernel_facts in zip(keys, facts):
        inst, uses = chosen[key]
        blocks = [k for k in inst.sgraph.kernels if isinstance(k, BlockKernel)]
        for k, f in zip(blocks, kernel_facts):
            demand = f.registers + f.stack_bytes / 4
            m = model_row(inst, k)
            rows.append({"sources": sorted({s for s, _ in uses}), "buckets": sorted({nt for _, nt in uses}),
                         "sm": key[0], "sgraph": inst.sgraph.name, "kernel": k.name, "assignment": inst.values, **m,
                         "ptxas_regs": f.registers, "stack_bytes": f.stack_bytes, "local_bytes": f.local_bytes,
                         "ptxas_shared": f.shared_bytes, "hgmma": f.hgmma, "hmma": f.hmma,
                         "reg_error": (m["model_regs"] - demand) / demand})
    spilled = [r for r in rows if r["stack_bytes"] + r["local_bytes"] > 0]
    checks = {
        "decode_spills": [r for r in spilled if min(r["buckets"]) <= DECODE_MAX],
        "decode_spills_after_screen": screened_spills(spilled, {s: p for s, p, _ in cases(args.quick)}),
        "dot_without_tensor_cores": [r for r in rows if r["model_dots"] and not r["hgmma"] + r["hmma"]],
        "register_estimate_off": [r for r in rows if abs(r["reg_error"]) > REG_TOLERANCE],
    }
    head = (f"{'sm':>3} {'source':34} {'buckets':14} {'kernel':24} {'assignment':28} {'w':>2} {'regs m/p':>9} "
            f"{'stack':>5} {'smem m/p':>15} {'dots':>4} {'HGMMA':>5} {'HMMA':>5} {'err':>5}")
    print(head)
    for r in rows:
        src = ",".join(r["sources"])[:34]
        bk = ",".join(map(str, r["buckets"]))[:14]
        asg = " ".join(f"{k}={v}" for k, v in r["assignment"].items())[:28]
        print(f"{r['sm']:>3} {src:34} {bk:14} {r['kernel'][:24]:24} {asg:28} {r['warps']:>2} "
              f"{r['model_regs']:>4}/{r['ptxas_regs']:<4} {r['stack_bytes']:>5} "
              f"{r['model_smem']:>7}/{r['ptxas_shared']:<7} {r['model_dots']:>4} {r['hgmma']:>5} {r['hmma']:>5} "
              f"{r['reg_error']:+5.0%}")
    errs = sorted(abs(r["reg_error"]) for r in rows)
    summary = {"compiler": compiler, "kernels": len(rows), "median_abs_error": errs[len(errs) // 2],
               "worst_abs_error": errs[-1], "within_tolerance": sum(e <= REG_TOLERANCE for e in errs),
               "tolerance": REG_TOLERANCE}
    print(f"\n{len(rows)} kernels; register estimate |error| median {errs[len(errs) // 2]:.0%}, "
          f"worst {errs[-1]:.0%}, within {REG_TOLERANCE:.0%}: {summary['within_tolerance']}/{len(errs)}")
    for name, bad in checks.items():
        print(f"{name}: {len(bad)}" + "".join(f"\n  sm_{r['sm']} {r['sgraph']}.{r['kernel']} {r['assignment']}"
                                               for r in bad[:10]))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "checks": {k: len(v) for k, v in checks.items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
