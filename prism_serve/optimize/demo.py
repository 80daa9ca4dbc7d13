"""The codegen demo: a workload's hand-built sGraph, instantiated, generated to Triton, run and checked.

This is the main job until `warmup` exists: it shows the whole optimize-side
path (Program -> sGraph -> instance -> Triton -> launch -> check vs reference).
"""

from __future__ import annotations

import os
import time

import torch
from rich.console import Console
from rich.table import Table

from prism_serve.errors import CodegenError
from prism_serve.optimize.workloads.programs import get_workload

# The interpreter runs a 256x512x256 matmul in ~0.65 s: matmul workloads get small dims there.
INTERPRETER_DIMS = {
    "rmsnorm_linear": {"hidden": 256, "out": 128}, "swiglu": {"hidden": 256, "intermediate": 128},
    "rmsnorm_mlp": {"hidden": 256, "intermediate": 128},
    "attention": {"batch": 2, "heads": 8, "q_len": 1, "kv_len": 256, "head_dim": 64},
}


def run_demo(workload: str, num_tokens: list[int], console: Console, gpu: str = "h100") -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before any kernel module is loaded
    from prism_serve.optimize.codegen.render import compile_instance, load, render
    from prism_serve.optimize.ir.reference import TOLERANCE, evaluate, max_rel_error, random_inputs
    from prism_serve.optimize.ir.sgraph import BlockKernel
    from prism_serve.optimize.target.gpus import get_gpu
    from prism_serve.optimize.workloads.oracles import fitting_instance, oracle

    w = get_workload(workload)
    dims = {} if on_gpu else INTERPRETER_DIMS.get(workload, {})
    prog = w.program(**dims, dtype="float16" if on_gpu else "float32")
    device = "cuda" if on_gpu else "cpu"
    console.print(f"[bold]{prog.name}[/] program {prog.canonical_hash} ({len(prog.nodes)} nodes) on "
                  f"{torch.cuda.get_device_name() if on_gpu else 'CPU through the Triton interpreter'}")
    for n in prog.inputs:
        console.print(f"  input {n.name}: {n.attr('shape')} {n.attr('dtype')}")
    g = oracle(prog)
    spec = get_gpu(gpu)
    inst = fitting_instance(g, spec, target_tile=64 if on_gpu else 32)
    console.print(f"sGraph [bold]{g.name}[/]: symbols {', '.join(g.symbols)}; instantiated for {spec.name} "
                  f"with {dict(inst.assignment)}")
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            tiles = {n.name: tuple(map(str, g.block_types(k)[n.name].shape)) for n in k.loads}
            console.print(f"  kernel {k.name}: grid {[a.symbol for a in k.grid]}, loop {k.forloop or '-'}, "
                          f"tiles {tiles}")
    source = render(inst)
    module = load(source)
    console.print(f"generated {len(source.splitlines())} lines of Triton: {module.__file__}")
    run = compile_instance(inst)
    tolerance = TOLERANCE[prog.inputs[0].attr("dtype")]
    table = Table("num_tokens", "outputs", "max rel error", "ok", "time (ms)",
                  title=f"generated kernel vs reference (tolerance {tolerance:g})")
    failed = []
    sizes = num_tokens if w.default_num_tokens else [0]
    for n in sizes:
        inputs = random_inputs(prog, n, device=device)
        start = time.perf_counter()
        got = run(*inputs)
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        ref = evaluate(prog, [t.cpu() for t in inputs])
        err = max(max_rel_error(a, r) for a, r in zip(got, ref))
        if err >= tolerance:
            failed.append(n)
        table.add_row(str(n) if w.default_num_tokens else "-", ", ".join(str(tuple(o.shape)) for o in got),
                      f"{err:.2e}", "yes" if err < tolerance else "[red]NO[/]", f"{elapsed:.1f}")
    console.print(table)
    if failed:
        raise CodegenError(f"{prog.name}: generated kernel disagrees with the reference at num_tokens {failed}")
