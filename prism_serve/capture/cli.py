"""`prism-serve capture [MODEL] [--json FILE]`: print the region table, optionally write JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from prism_serve.capture.embedded import DEFAULT_MODEL, EMBEDDED
from prism_serve.errors import PrismError


def _table(result) -> str:
    head = f"{'region':<20} {'program':<12} {'dims':<40} {'layers':<10} {'time':>6}  buckets"
    lines = [f"model {result.model} ({result.architecture}, {result.load_format} weights, run in {result.dtype}); "
             f"num_tokens seen {result.num_tokens}", head, "-" * len(head)]
    for r in result.regions:
        dims = ",".join(f"{k}={v}" for k, v in r.dims.items()) + (f",eps={r.eps:g}" if r.eps is not None else "")
        if r.rows_per_token not in ([], [1]):
            dims += ",rows/token=" + "|".join(map(str, r.rows_per_token))
        prog = r.program.canonical_hash[:10] if r.program else "unsupported"
        layers = ",".join(map(str, r.layers)) or "-"
        lines.append(f"{r.kind:<20} {prog:<12} {dims:<40} {layers:<10} {100 * r.time_share:5.1f}%  "
                     f"{r.buckets}" + ("" if r.supported else f"  ({r.reason})"))
    if result.attention_shapes:
        lines.append("attention forwards (sequences x longest query x longest kv: count): " + ", ".join(
            f"{s['batch']}x{s['q_len']}x{s['kv_len']}: {s['count']}" for s in result.attention_shapes))
    return "\n".join(lines)


def capture_command(
    model: Optional[str] = typer.Argument(
        None, help=f"model directory with config.json, or an embedded model ({', '.join(EMBEDDED)}); "
                   f"default {DEFAULT_MODEL}"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the capture report as JSON here"),
    dtype: str = typer.Option("auto", "--dtype", help="vLLM's dtype for the model: auto (vLLM's choice, as `vllm "
                                                      "serve` runs it), float32, bfloat16 or float16"),
) -> None:
    """Run a model under vLLM, find its hot fusable regions and print them as Programs."""
    from prism_serve.capture.runner import capture
    from prism_serve.paths import check_writable

    try:
        if json_file is not None:
            check_writable(json_file, "capture report")  # before the capture's half minute, not after
        result = capture(model, dtype)
    except PrismError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(_table(result))
    if json_file is not None:
        json_file.write_text(json.dumps(result.to_json(), indent=1))
        typer.echo(f"wrote {json_file}")


