"""`prism-serve registry ...`: thin commands over the store; errors become one line and exit 1."""

from __future__ import annotations

import contextlib
import json
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from prism_serve.errors import PrismError
from prism_serve.registry import exchange, store
from prism_serve.registry.db import (
    Registry,
    current_revision,
    describe,
    head_revision,
    open_registry,
    resolve_url,
    seal,
    sqlite_file,
)
from prism_serve.registry.errors import MissingRegistry

registry_app = typer.Typer(help="Inspect and manage the kernel registry.", no_args_is_help=True)
RegistryOpt = Annotated[str | None, typer.Option(
    "--registry", help="Path or SQLAlchemy URL (default: $PRISM_SERVE_REGISTRY or the cache file).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _console() -> Console:
    return Console()


@contextlib.contextmanager
def _opened(location: str | None, readonly: bool = False, existing: bool = False) -> Iterator[Registry]:
    """The registry, for the command's lifetime; reading commands never create or write it, nor do
    `existing` ones (removals: a mistyped path is an error, not a new empty registry)."""
    try:
        path = sqlite_file(resolve_url(location))
        if existing and path is not None and not path.is_file():
            raise MissingRegistry(f"no registry at {path}")
        reg = open_registry(location, readonly=readonly)
    except PrismError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        yield reg
    except PrismError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        reg.close()


def _escaped(c: str) -> str:
    if c == " " or unicodedata.category(c)[0] not in "CZ":  # control, format, separator
        return c
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


def shown(value: object) -> Text:
    """A table cell: stored text with control and format characters escaped (a reason from a
    registry or an export may carry terminal escape sequences) and never read as rich markup."""
    return Text("".join(map(_escaped, value if isinstance(value, str) else json.dumps(value))))


def _params(k) -> dict | str:
    try:
        return store.decode_params(k)
    except PrismError as exc:
        return f"invalid: {exc}"


def _row(k) -> dict:
    return {"id": k.id, "program": k.program.name, "program_hash": k.program.hash, "sgraph": k.sgraph.name,
            "device": k.device.fingerprint, "dtype": k.dtype, "bucket": [k.bucket_lo, k.bucket_hi],
            "params": _params(k), "measured_us": k.measured_us, "modeled_us": k.modeled_us,
            "baseline": k.baseline, "baseline_us": k.baseline_us, "speedup": k.speedup,
            "baseline_modeled_us": k.baseline_modeled_us, "modeled_speedup": k.modeled_speedup,
            "vs_vllm": _vs_vllm(k), "status": k.status, "reason": k.reason, "codegen_version": k.codegen_version}


def _vs_vllm(k) -> dict | None:
    found = store.speedup_vs_vllm(k)
    return None if found is None else {"speedup": found[0], "kind": found[1]}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


@registry_app.command("list")
def list_cmd(registry: RegistryOpt = None, device: Annotated[str | None, typer.Option()] = None,
             program: Annotated[str | None, typer.Option(help="Program name or hash prefix.")] = None,
             status: Annotated[str | None, typer.Option()] = None,
             dtype: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False) -> None:
    """List kernels, optionally filtered."""
    with _opened(registry, readonly=True) as reg, reg.read() as s:
        rows = [_row(k) for k in store.list_kernels(s, device=device, program=program, status=status, dtype=dtype)]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title=f"{len(rows)} kernels in {describe(reg.url)}")
    # modeled and measured times in separate columns, vLLM's path beside each; the speedup over
    # vLLM's path is the measured one where a device timed both, else the modeled one, and says which
    for col in ("id", "program", "hash", "device", "dtype", "tokens", "modeled us", "vLLM modeled us",
                "measured us", "baseline", "baseline us", "vs vLLM", "status", "reason"):
        table.add_column(col)
    for r in rows:
        vs = r["vs_vllm"]
        table.add_row(*map(shown, (str(r["id"]), r["program"], r["program_hash"][:10], r["device"], r["dtype"],
                                   f"{r['bucket'][0]}-{r['bucket'][1]}", _fmt(r["modeled_us"]),
                                   _fmt(r["baseline_modeled_us"]), _fmt(r["measured_us"]), r["baseline"] or "-",
                                   _fmt(r["baseline_us"]), f"{vs['speedup']:.2f}x {vs['kind']}" if vs else "-",
                                   r["status"], r["reason"])))
    _console().print(table)


@registry_app.command()
def show(kernel_id: int, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Show one kernel with its sGraph, proof and test metadata."""
    with _opened(registry, readonly=True) as reg, reg.read() as s:
        k = store.get_kernel(s, kernel_id)
        row = _row(k) | {"versions": {"torch": k.torch_version, "triton": k.triton_version,
                                      "vllm": k.vllm_version, "prism": k.prism_version},
                         "proof": k.sgraph.proof, "tests": k.sgraph.tests,
                         "sources": [[x.model, x.layer_path] for x in k.program.sources],
                         "incompatible": store.incompatibility(k, store.current_versions())}
    if as_json:
        typer.echo(json.dumps(row, indent=1))
        return
    table = Table(title=f"kernel {kernel_id}", show_header=False)
    for key, value in row.items():
        table.add_row(key, shown(value))
    _console().print(table)


@registry_app.command("export")
def export_cmd(path: Path, registry: RegistryOpt = None, device: Annotated[str | None, typer.Option()] = None,
               program: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False) -> None:
    """Write kernels to a portable JSON file (data only)."""
    with _opened(registry, readonly=True) as reg, reg.read() as s:
        n = exchange.export_file(s, path, device=device, program=program)
    typer.echo(json.dumps({"exported": n, "path": str(path)}) if as_json else f"exported {n} kernels to {path}")


@registry_app.command("import")
def import_cmd(path: Path, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Validate every record of an export, re-verify each here (egglog proof and numeric check), then
    import them all in one transaction (or none). Imported kernels are `verified`, never `enabled`."""
    from prism_serve.optimize.cli import interpret_unless_gpu
    from prism_serve.registry.gate import admit
    interpret_unless_gpu()
    try:  # everything is checked before the registry is even opened
        results = admit(exchange.read_export(path), imported=True)
    except PrismError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)  # one line, whatever the cause said
        raise typer.Exit(1) from None
    with _opened(registry) as reg, reg.write() as s:
        n = exchange.import_results(s, results)
    kept = f" ({len(results) - n} already here, left as they were)" if len(results) > n else ""
    typer.echo(json.dumps({"imported": n}) if as_json else f"imported {n} kernels from {path}{kept}")


@registry_app.command()
def rm(kernel_ids: Annotated[list[int], typer.Argument(help="Kernel ids to remove.")], registry: RegistryOpt = None,
       as_json: JsonOpt = False) -> None:
    """Remove kernels by id."""
    with _opened(registry, existing=True) as reg, reg.write() as s:
        n = store.remove_kernels(s, kernel_ids)
    typer.echo(json.dumps({"removed": n}) if as_json else f"removed {n} kernels")


@registry_app.command()
def gc(registry: RegistryOpt = None, incompatible: Annotated[bool, typer.Option(
        help="Also drop kernels of another codegen version.")] = False, as_json: JsonOpt = False) -> None:
    """Drop sGraphs, programs and devices no kernel uses."""
    with _opened(registry, existing=True) as reg, reg.write() as s:
        removed = store.gc(s, incompatible=incompatible)
    typer.echo(json.dumps(removed) if as_json else ", ".join(f"removed {v} {k}" for k, v in removed.items()))


@registry_app.command("seal")
def seal_cmd(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Fold a SQLite registry's write-ahead log into its file and leave WAL mode, so the one file
    can be shipped and read from a read-only volume (a later write switches WAL back on)."""
    try:
        path = seal(registry)
    except PrismError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"sealed": str(path)}) if as_json else f"sealed {path}: one file, readable read-only")


@registry_app.command()
def doctor(registry: RegistryOpt = None, device: Annotated[str | None, typer.Option(
        help="Device fingerprint to explain loading for, e.g. gpu:h200:sm9.0:132sms.")] = None,
           as_json: JsonOpt = False) -> None:
    """Where the registry is, its schema, what it holds, and what this device would load and why not."""
    try:
        url = resolve_url(registry)
    except PrismError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    with _opened(registry, readonly=True) as reg:
        report: dict = {"registry": describe(url), "schema_revision": current_revision(reg.engine),
                        "schema_head": head_revision(), "versions": vars(store.current_versions())}
        with reg.read() as s:
            report["counts"] = store.counts(s)
            if device:
                report["device"] = device
                report["kernels"] = store.explain(s, device)
            if reg.is_sqlite:
                report["integrity"] = s.connection().exec_driver_sql("PRAGMA quick_check").scalar()
                report["journal_mode"] = s.connection().exec_driver_sql("PRAGMA journal_mode").scalar()
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    table = Table(title="prism-serve registry doctor", show_header=False)
    for key, value in report.items():
        table.add_row(key, shown(value))
    _console().print(table)
