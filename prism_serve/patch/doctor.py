"""`prism-serve doctor <model>`: which layers of a model the plugin would patch on this device,
and why the others would not. Reads the model's config.json (no vLLM run) and the registry
the plugin would read, through the plugin's own `plan()`.

    patch_report(model=None, registry=None, dtype=None, force=None) -> dict
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prism_serve.capture.embedded import resolve_model
from prism_serve.patch.table import OPS, TORCH_DTYPES

# decoder-only models whose layers vLLM builds from RMSNorm and SiluAndMul
ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}
QK_NORM = {"Qwen3ForCausalLM"}
NORM_LINEAR = {"LlamaForCausalLM", "Qwen3ForCausalLM"}  # decoder layers whose input norm + qkv_proj fuse


@dataclass(frozen=True)
class Site:
    """One call of a vLLM op in the model: layer path, op, the size the kernel is keyed by."""

    layer: str
    op: str
    dim: int
    eps: float | None
    note: str = ""


def sites(cfg: dict) -> list[Site]:
    """vLLM's op calls per decoder layer: the first layer's input norm has no residual yet."""
    arch = (cfg.get("architectures") or [""])[0]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    qkv = (heads + 2 * kv_heads) * head_dim
    out = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append(Site(p + "input_layernorm", "rms_norm" if i == 0 else "fused_add_rms_norm", hidden, eps))
        if arch in NORM_LINEAR:
            out.append(Site(p + "self_attn", "rmsnorm_linear", (hidden, qkv), eps,
                            "input_layernorm + qkv_proj as one region"))
        if arch in QK_NORM:
            out += [Site(p + "self_attn.q_norm", "rms_norm", head_dim, eps, "rows are tokens x heads"),
                    Site(p + "self_attn.k_norm", "rms_norm", head_dim, eps, "rows are tokens x kv heads")]
        out.append(Site(p + "post_attention_layernorm", "fused_add_rms_norm", hidden, eps))
        out.append(Site(p + "mlp", "swiglu", (hidden, inter), None, "gate_up_proj + act_fn as one region"))
        out.append(Site(p + "mlp.act_fn", "silu_and_mul", inter, None))
    out.append(Site("model.norm", "fused_add_rms_norm", hidden, eps))
    return out


def patch_report(model: str | Path | None = None, registry: str | None = None, dtype: str | None = None,
                 force: bool | None = None) -> dict:
    """What the plugin would patch for `model` (default: the embedded tiny model) on this device."""
    from prism_serve.patch.device import current_device
    from prism_serve.patch.plugin import plan
    from prism_serve.registry.db import resolve_url

    path = resolve_model(model)
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    dtype = dtype or _dtype(cfg)
    device, device_type = current_device(use_vllm=False)
    url = resolve_url(registry)
    p = plan(url, device, device_type, force)
    report = {"model": str(path), "architecture": arch, "dtype": dtype, "device": device.fingerprint,
              "registry": p.where, "plugin": p.state if p.state != "ready" else "would patch",
              "message": p.message, "skipped": dict(p.reasons), "layers": []}
    if arch not in ARCHITECTURES:
        report["message"] = f"architecture {arch!r} is not one whose layers prism knows ({', '.join(sorted(ARCHITECTURES))})"
        return report
    rows = [_explain(s, dtype, p, url, device) for s in sites(cfg)]
    regions = {r["layer"] for r in rows if r["op"] in ("swiglu", "rmsnorm_linear") and r["patched"]}
    for r in rows:
        inside = {"silu_and_mul": (".act_fn", ""), "rms_norm": (".input_layernorm", ".self_attn"),
                  "fused_add_rms_norm": (".input_layernorm", ".self_attn")}.get(r["op"])
        if inside and r["layer"].endswith(inside[0]) and r["layer"].removesuffix(inside[0]) + inside[1] in regions:
            r.update(patched=True, why="runs inside its layer's region kernel")
            r.pop("buckets", None)
    report["layers"] = rows
    return report


def _dtype(cfg: dict) -> str:
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
    return dt if dt in TORCH_DTYPES else "float16"


def _explain(s: Site, dtype: str, p, url: str, device) -> dict:
    row = {"layer": s.layer, "op": s.op, "dim": s.dim, "patched": False}
    if s.note:
        row["note"] = s.note
    entry = p.table.entry(s.op, TORCH_DTYPES[dtype], s.dim, s.eps) if p.table is not None else None
    if entry is not None:
        row["patched"] = True
        row["buckets"] = [f"{lo}-{hi}: kernel {lz.kernel_id}" for lo, hi, lz in zip(entry.los, entry.his,
                                                                                  entry.launchers)]
        row["why"] = "kernels for every num_tokens in these buckets; other sizes run vLLM's own path"
        return row
    if p.state != "ready" and p.message:
        row["why"] = p.message.removeprefix("prism-serve: ")
        return row
    row["why"] = _why_not(s, dtype, url, device, p)
    return row


def _status(status: str) -> str:
    if status == "verified":
        return "status verified: not measured faster than vLLM here (PRISM_SERVE_FORCE=1 uses it anyway)"
    return f"status {status}"


def _why_not(s: Site, dtype: str, url: str, device, p) -> str:
    """Why the registry has nothing usable for this site's exact program."""
    from prism_serve.registry.db import open_registry
    from prism_serve.registry.store import current_versions, incompatibility, list_kernels

    prog = OPS[s.op].build(s.dim, dtype, s.eps)
    dims = ", ".join(map(str, s.dim)) if isinstance(s.dim, tuple) else str(s.dim)
    reg = open_registry(url, readonly=True)
    try:
        with reg.read() as session:
            rows = list_kernels(session, program=prog.canonical_hash)
            if not rows:
                return (f"no kernel in the registry for {s.op} ({dims}, {dtype}"
                        f"{f', eps {s.eps}' if s.eps is not None else ''}): run `prism-serve warmup`")
            mine = [k for k in rows if k.device.fingerprint == device.fingerprint]
            if not mine:
                return f"kernels only for other devices: {sorted({k.device.fingerprint for k in rows})}"
            env, failed = current_versions(), dict(p.table.skipped)
            reasons = sorted({failed.get(k.id) or incompatibility(k, env) or _status(k.status) for k in mine})
            return "this device's kernels are not usable: " + "; ".join(reasons)
    finally:
        reg.close()


def print_patch_report(report: dict, console=None) -> None:
    """The report as a table, for `prism-serve doctor <model>` (JSON: print `report` itself)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = (f"{report['model']} ({report['architecture']}, {report['dtype']}) on {report['device']}: "
             f"{report['plugin']}")
    table = Table("layer", "op", "patched", "kernels / why not", title=title)
    for row in report["layers"]:
        detail = ", ".join(row["buckets"]) if row.get("buckets") else row.get("why", "")
        table.add_row(row["layer"], row["op"], "yes" if row["patched"] else "no", detail)
    console.print(table)
    console.print(f"registry: {report['registry']}" + (f" — {report['message']}" if report["message"] else ""))
    if report["skipped"]:
        console.print("skipped kernels: " + "; ".join(f"{why} ({n})" for why, n in report["skipped"].items()))
