"""`prism-serve optimize <workload | program.json>`: generate (Prism's generator), verify, instantiate; print the table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from prism_serve.console import progress_for, stdout_console, summary_console
from prism_serve.errors import PrismError, ProgramError, SGraphError


def _program(target: str, shapes: list[str]):
    from prism_serve.optimize.ir.schema import program_from_json
    from prism_serve.optimize.workloads.programs import WORKLOADS

    path = Path(target)
    if target.endswith(".json") or path.exists():
        if shapes:
            raise ProgramError("--shape sets a workload's dims; a program file already fixes them")
        if not path.is_file():
            raise ProgramError(f"program file {target} does not exist")
        return program_from_json(path.read_text()), ()
    if target not in WORKLOADS:
        raise ProgramError(f"{target!r} is neither a workload ({', '.join(WORKLOADS)}) nor a program .json file")
    dims = {}
    for item in shapes:
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ProgramError(f"--shape takes name=int, got {item!r}")
        dims[key.strip()] = int(value)
    w = WORKLOADS[target]
    try:
        return w.program(**dims), w.default_num_tokens
    except TypeError as exc:
        raise ProgramError(f"workload {target!r}: {exc}") from None


def _table(result, compact: bool = False) -> Table:
    """The verified designs, with their canonical hash; `compact`: folded to about 100 columns, the
    design, its hash and ptxas's facts left to `_notes`."""
    from prism_serve.baseline import served_modeled_us, vllm_modeled_us
    from prism_serve.optimize.ir.canonical import canonical_hash
    from prism_serve.optimize.target.gpus import get_gpu
    from prism_serve.optimize.ir.sgraph import BlockKernel
    from prism_serve.region_table import KINDS

    buckets, prog = result.num_tokens, result.program
    spec = get_gpu(result.gpu)
    vllm = {n: vllm_modeled_us(prog, n, spec) for n in buckets} if prog.name in KINDS else None
    measured = any(c.measured_us is not None for f in result.found for c in f.kernels)
    compiled = any(c.facts is not None for f in result.found for c in f.kernels)
    about = (f"vLLM's path: {', '.join(f'{vllm[n]:.1f} us @{n}' for n in buckets)} modeled" if vllm else
             "vLLM has no path for this program, so no speedup")
    title = f"{prog.name} on {result.gpu}: verified kernels ({about})"
    if compact:
        table = Table("#", "kernels", "grid", "loop", f"modeled us @{', '.join(map(str, buckets))}",
                      *((f"measured us @{', '.join(map(str, buckets))}",) if measured else ()),
                      "vs vLLM modeled", title=title)
    else:
        table = Table("#", "design", "canonical hash", "kernels",
                      "grid", "loop", *(f"modeled us @{n}" for n in buckets),
                      *((f"measured us @{n}" for n in buckets) if measured else ()),
                      *((f"sm_{spec.arch} registers (stack bytes), per bucket",) if compiled else ()),
                      "vs vLLM modeled, per bucket", title=title)
    for i, f in enumerate(result.found):
        c = f.kernels[-1]
        blocks = [k for k in f.sgraph.kernels if isinstance(k, BlockKernel)]
        grid = "; ".join("x".join(f"{a.symbol}={c.assignment[a.symbol]}" for a in k.grid) for k in blocks)
        loop = "; ".join(f"{k.forloop}={c.assignment[k.forloop]}" if k.forloop else "-" for k in blocks) or "-"
        speed = ", ".join(f"{vllm[n] / served_modeled_us(prog, f.kernel_for(n).modeled_us, n, spec):.2f}x"
                          for n in buckets) if vllm else "-"
        if compact:
            table.add_row(str(i + 1), str(len(f.sgraph.kernels)), grid or "library", loop,
                          ", ".join(f"{f.kernel_for(n).modeled_us:.2f}" for n in buckets),
                          *((", ".join(_us(f.kernel_for(n).measured_us) for n in buckets),) if measured else ()),
                          speed)
            continue
        table.add_row(str(i + 1), f.design.describe(), canonical_hash(f.sgraph)[:16],
                      str(len(f.sgraph.kernels)), grid or "library", loop,
                      *(f"{f.kernel_for(n).modeled_us:.2f}" for n in buckets),
                      *((_us(f.kernel_for(n).measured_us) for n in buckets) if measured else ()),
                      *((", ".join(_ptxas(f.kernel_for(n).facts) for n in buckets),) if compiled else ()), speed)
    return table


def print_designs(result, console: Console, verbose: bool = False) -> None:
    """The designs' table: every column with `verbose` or where it fits the console; else folded,
    each design's description, hash and ptxas's facts in one numbered note under the table."""
    from prism_serve.optimize.ir.canonical import canonical_hash

    full = _table(result)
    if verbose or Measurement.get(console, console.options.update_width(1 << 16), full).maximum <= console.width:
        console.print(full)
        return
    console.print(_table(result, compact=True))
    compiled = any(c.facts is not None for f in result.found for c in f.kernels)
    for i, f in enumerate(result.found, 1):
        ptxas = "; ptxas registers (stack bytes) per bucket " + ", ".join(
            _ptxas(f.kernel_for(n).facts) for n in result.num_tokens) if compiled else ""
        console.print(f"{i}. {canonical_hash(f.sgraph)[:16]} {f.design.describe()}{ptxas}", highlight=False,
                      markup=False)


def _ptxas(facts) -> str:
    """An instance's ptxas registers (stack bytes) per block kernel; "-" where not compiled."""
    return "-" if facts is None else " + ".join(f"{f.registers} ({f.stack_bytes})" for f in facts) or "library"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _emit(result, directory: Path) -> list[Path]:
    from prism_serve.optimize.codegen.render import render

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for i, f in enumerate(result.found, 1):
        for c in f.kernels:
            path = directory / f"{result.program.name}_{i}_n{c.num_tokens}.py"
            path.write_text(render(c.instance))
            written.append(path)
        path = directory / f"{result.program.name}_{i}.json"
        path.write_text(json.dumps(f.to_json(), indent=1))
        written.append(path)
    return written


def optimize_command(
    target: str = typer.Argument(..., help="a workload name (see `prism-serve workloads`) or a program .json file"),
    device: str = typer.Option("h100", "--device", help="GPU to optimize for: h100, h200, a100, l40s"),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help="workload dim, name=int (repeatable)"),
    num_tokens: Optional[List[int]] = typer.Option(None, "--num-tokens", "-n", help="num_tokens buckets"),
    emit: Optional[Path] = typer.Option(None, "--emit", help="write each verified kernel's Triton source here"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the result (designs, sGraphs, stats) here"),
    budget: float = typer.Option(60.0, "--budget", help="seconds the search may take"),
    work: Optional[int] = typer.Option(None, "--work", help="steps of generation work (default: 50,000 per second "
                                                            "of --budget); the result depends on it, not on time"),
    top: int = typer.Option(3, "--top", help="how many verified designs to return"),
    max_kernels: int = typer.Option(2, "--max-kernels", help="most kernels per design"),
    all_designs: bool = typer.Option(False, "--all", help="verify and list every generated design (no cost rule, "
                                                          "no --top), with its canonical hash"),
    workers: Optional[int] = typer.Option(None, "--workers", help="generator worker processes (default: the cores; "
                                                                  "with --ray, the cluster's CPUs)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS",
                                      help="run the search's subtrees as Ray tasks: 'local' (a cluster of this "
                                           "machine's cores, started here), 'auto' or a cluster's address; the "
                                           "result is the same as a local run (needs prism-serve\\[ray])"),
    max_block_ops: int = typer.Option(8, "--max-block-ops",
                                      help="most block ops per graph-defined kernel (a one-kernel design's: at least the "
                                           "Program's)"),
    static_check: bool = typer.Option(True, "--static-check/--no-static-check",
                                      help="compile the chosen instances for the device's architecture (no GPU needed) "
                                           "and keep, per bucket, the best-ranked one ptxas does not spill"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress on stderr"),
    no_progress: bool = typer.Option(False, "--no-progress", help="progress as plain lines, not a live display"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="the table with every column, however wide"),
) -> None:
    """Superoptimize a Program with Prism's generator: designs built operator by operator, egglog
    proofs, numeric checks, tuned instances."""
    interpret_unless_gpu()
    display = None
    try:
        prog, default_tokens = _program(target, list(shape or []))
        buckets = list(num_tokens or default_tokens[-1:] or [1])
        if workers is not None and workers < 1:  # before progress starts, so that a bad option is one line
            raise SGraphError(f"workers must be a positive int, got {workers!r}")
        if ray is not None:
            from prism_serve.optimize.pipeline.ray_pool import ray_module
            ray_module()  # missing: one line saying how to install it
        display = progress_for(quiet=quiet, plain=no_progress, prefix="optimize")
        display(f"search {prog.name}", 0, 1)

        def progress(message: str, stats) -> None:
            display.detail(f"{message}, {sum(stats.pruned.values())} pruned")
        from prism_serve.optimize.pipeline.search import optimize
        result = optimize(prog, device, buckets, budget_s=budget, work=work, top=top, max_kernels=max_kernels,
                          max_block_ops=max_block_ops, all_designs=all_designs, workers=workers,
                          progress=progress, static_check=static_check, ray=ray)
    except BaseException as exc:
        if display is not None:
            display.close(stopped=True)
        if not isinstance(exc, PrismError):
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    display.close()
    console = stdout_console() if verbose else summary_console()
    print_designs(result, console, verbose)
    s = result.stats
    size = f"{s.designs} designs, {s.kernel_graphs} kernel graphs, {s.block_graphs} block graphs, {s.workers} workers"
    cut = f"; the work ran out with {s.open_subtrees} subtrees left open" if s.open_subtrees else ""
    checked = f", ptxas check {s.static_s:.1f} s" if static_check else ""
    console.print(f"search {s.search_s:.1f} s (verification {s.verify_s:.1f} s{checked}), {size}, "
                  f"{s.steps} of {s.work} steps, "
                  "pruned " + ", ".join(f"{k} {v}" for k, v in s.pruned.items()) + cut
                  + ("; stopped by the time budget (the result may depend on this machine's speed)"
                     if s.stopped_by_budget else "")
                  + (f"; {s.static_spilled} buckets kept an instance that spills (none ranked near it does not)"
                     if s.static_spilled else ""), highlight=False, markup=False)
    if emit is not None:
        for path in _emit(result, emit):
            typer.echo(f"wrote {path}")
    if json_file is not None:
        json_file.write_text(json.dumps(result.to_json(), indent=1))
        typer.echo(f"wrote {json_file}")
    if not result.found:
        typer.echo(" ".join(filter(None, ["error: no verified kernel found", s.limit()])), err=True)
        raise typer.Exit(1)


def interpret_unless_gpu() -> None:
    """Run generated kernels through Triton's CPU interpreter when there is no GPU (unless the user
    chose); must happen before triton is first imported."""
    import torch

    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
