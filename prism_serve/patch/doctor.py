"""`prism-serve doctor <model>`: which layers of a model the plugin would patch on this device,
and why the others would not, through the plugin's own `plan()` of the registry it would read.

The sites come from the model's config.json (no vLLM run) for the decoder architectures whose
layers are written out below (`ARCHITECTURES`); for any other architecture, or when asked, from
a capture: vLLM runs the model once and the fusion pass's own matcher reports each region it
would replace (`prism_serve.capture`), so every architecture vLLM compiles gets a per-layer
report, unsupported regions with the matcher's reason.

    patch_report(model=None, registry=None, dtype=None, force=None, capture=None) -> dict
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from prism_serve.capture.embedded import resolve_model
from prism_serve.optimize.ir.ops import Op
from prism_serve.patch.explain import mismatch
from prism_serve.patch.seed import rotary_dims
from prism_serve.patch.table import TORCH_DTYPES
from prism_serve.region_table import KINDS, Form, kind_of

# decoder-only models whose layers vLLM builds from RMSNorm and SiluAndMul -> the classes of a
# decoder layer and of its MLP (what the eager-mode class hooks go by; Qwen3's MLP is Qwen2MLP)
LAYER_CLASSES = MappingProxyType({"LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaMLP"),
                 "MistralForCausalLM": ("MistralDecoderLayer", "LlamaMLP"),
                 "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2MLP"),
                 "Qwen3ForCausalLM": ("Qwen3DecoderLayer", "Qwen2MLP")})
ARCHITECTURES = frozenset(LAYER_CLASSES)
QK_NORM = frozenset({"Qwen3ForCausalLM"})
# a qkv projection with a bias: the input side's kinds are the `_bias` ones (compiled mode only)
BIASED_QKV = frozenset({"Qwen2ForCausalLM"})
# vLLM's rotary class by the config's rope type (`get_rope`), where the eager replacement covers it
ROPE_CLASSES = MappingProxyType({"default": "RotaryEmbedding", "llama3": "Llama3RotaryEmbedding",
                                 "yarn": "YaRNScalingRotaryEmbedding"})


@dataclass(frozen=True)
class Site:
    """One place the plugin could serve in the model: the module the row names, the region kind,
    the size the kernel is keyed by, and the modules the region spans (the row's own by default)."""

    layer: str
    op: str
    dim: int | tuple
    eps: float | None
    note: str = ""
    spans: tuple[str, ...] = ()

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(self.spans or (self.layer,))


def _kind(**form) -> str:
    return kind_of(Form(**form)).name


def sites(cfg: dict) -> list[Site]:
    """vLLM's ops and the region table's regions per decoder layer: the first layer's input norm
    has no residual yet. Larger regions come first."""
    arch = (cfg.get("architectures") or [""])[0]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    qkv = (heads + 2 * kv_heads) * head_dim
    norm, add_norm, silu = _kind(norm="rms"), _kind(norm="rms", residual=True), _kind(act=Op.SILU)
    mlp, post = _kind(projection=True, act=Op.SILU), _kind(norm="rms", projection=True, act=Op.SILU)
    rotary, qk_rotary = _kind(rotary=True), _kind(norm="rms", rotary=True)
    rot_dims = rotary_dims(cfg)
    rotary_key = KINDS[rotary].key_dim(rot_dims) if rot_dims else None
    out = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        spans = {k: tuple(p + m for m in KINDS[k].modules) for k in KINDS if KINDS[k].modules}
        if arch in ARCHITECTURES:
            side = _kind(norm="rms", residual=i > 0, projection=True, bias=arch in BIASED_QKV)
            out += [Site(p + "self_attn", side, (hidden, qkv), eps, "input_layernorm + qkv_proj as one kernel",
                         spans[side]),
                    Site(p + "mlp", post, (hidden, inter), eps,
                         "post_attention_layernorm + gate_up_proj + act_fn as one kernel", spans[post])]
        out.append(Site(p + "mlp.gate_up_proj", mlp, (hidden, inter), None, "gate_up_proj + act_fn as one kernel",
                        spans[mlp]))
        out.append(Site(p + "input_layernorm", norm if i == 0 else add_norm, hidden, eps))
        rot = p + "self_attn.rotary_emb"
        if arch in QK_NORM:
            qk = (p + "self_attn.q_norm", p + "self_attn.k_norm", rot)
            if rotary_key:  # the config names the rotary cache's size
                out.append(Site("+".join(qk), qk_rotary, rotary_key, eps, "q_norm + k_norm + rotary_emb as one kernel",
                                qk))
            out += [Site(p + "self_attn.q_norm", norm, head_dim, eps, "rows are tokens x heads"),
                    Site(p + "self_attn.k_norm", norm, head_dim, eps, "rows are tokens x kv heads")]
        if arch in ARCHITECTURES and rotary_key:
            out.append(Site(rot, rotary, rotary_key, None, "q and k rotated by position"))
        out.append(Site(p + "post_attention_layernorm", add_norm, hidden, eps))
        out.append(Site(p + "mlp.act_fn", silu, inter, None))
    out.append(Site("model.norm", add_norm, hidden, eps))
    return out


def config_classes(cfg: dict) -> dict[str, str]:
    """Module path -> class name of each decoder layer and its MLP, for an architecture of `LAYER_CLASSES`."""
    layer, mlp = LAYER_CLASSES.get((cfg.get("architectures") or [""])[0], (None, None))
    if layer is None:
        return {}
    out = {}
    rope = (cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rotary = ROPE_CLASSES.get(rope.get("rope_type", rope.get("type", "default")))
    for i in range(cfg["num_hidden_layers"]):
        out[f"model.layers.{i}"], out[f"model.layers.{i}.mlp"] = layer, mlp
        if rotary is not None:
            out[f"model.layers.{i}.self_attn.rotary_emb"] = rotary
    return out


def capture_sites(capture: dict) -> list[Site]:
    """Every region instance a capture report (`CaptureResult.to_json()`) lists, one site per
    layer instance, larger regions first; unsupported ones carry the matcher's reason as note."""
    out = []
    for region in capture["regions"]:
        kind = KINDS.get(region["kind"])
        dim = kind.key_dim(region["dims"]) if kind is not None and region["supported"] else \
            tuple(region["dims"].values())
        for joined in region["modules"]:
            spans = tuple(joined.split("+"))
            out.append(Site(joined, region["kind"], dim, region.get("eps"),
                            "" if region["supported"] else f"unsupported: {region['reason']}", spans))
    return sorted(out, key=lambda s: -len(s.modules))


def patch_report(model: str | Path | None = None, registry: str | None = None, dtype: str | None = None,
                 force: bool | None = None, lora: bool = False, capture: dict | bool | None = None) -> dict:
    """What the plugin would patch for `model` (default: the embedded tiny model) on this device,
    and, per region kind the registry holds for the model's sizes, the layers it would serve.
    Each row names the region kind (`op`) and the chain of vLLM ops it matches (`pattern`); a
    patched row (compiled mode, vLLM's default) the kernels serving it, any other row why not;
    `eager` whether eager mode (`enforce_eager`) serves it too, and if not, `eager_why`. `dtype`:
    the one vLLM serves the model in (`vllm serve --dtype`), None or "auto" for vLLM's default
    (a float32 checkpoint runs in bfloat16): kernels are looked up for it. `lora`: vLLM runs the model with
    LoRA adapters (they wrap its projections). `capture`: a capture report to take the sites from,
    True to capture the model now, None to capture only an architecture not in `ARCHITECTURES`
    (`sites_from` in the report says which)."""
    from prism_serve.capture.runner import _validate
    from prism_serve.patch.device import current_device
    from prism_serve.patch.plugin import plan
    from prism_serve.registry.db import resolve_url

    path = resolve_model(model)
    _validate(path)  # capture's checks: the same one-line errors for a path or config it cannot use
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    if capture is True or (capture is None and arch not in ARCHITECTURES):
        from prism_serve.capture.runner import capture as run_capture
        capture = run_capture(path, dtype or "auto").to_json()
    ran = {r["dtype"] for r in capture["regions"]} if isinstance(capture, dict) else set()
    ran = {capture["dtype"]} if isinstance(capture, dict) and capture.get("dtype") else ran
    if dtype in (None, "auto"):  # what vLLM ran, where captured; else what its dtype="auto" runs
        dtype = ran.pop() if len(ran) == 1 else serving_dtype(_dtype(cfg, path))
    url = resolve_url(registry)
    device, device_type = current_device(use_vllm=False, registry=url)
    p = plan(url, device, device_type, force)
    report = {"model": str(path), "architecture": arch, "dtype": dtype, "model_dtype": _dtype(cfg, path),
              "device": device.fingerprint,
              "registry": p.where, "plugin": p.state if p.state != "ready" else "would patch",
              "message": p.message, "skipped": dict(p.reasons), "layers": [], "served": {}, "unserved": []}
    if not isinstance(capture, dict):
        report["sites_from"] = "config.json"
        try:
            all_sites, classes = sites(cfg), config_classes(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path / 'config.json'} does not describe a {arch}'s layers: "
                             f"{type(exc).__name__} {exc}") from None
    else:
        report["sites_from"] = "capture: the regions vLLM's compiled graph holds, as the fusion pass matches them"
        all_sites, classes = capture_sites(capture), capture.get("classes", {})
    quant = cfg.get("quantization_config") or None
    rows = [_explain(s, dtype, p, url, device, _never(s, dtype, quant, lora), str(path)) for s in all_sites]
    own = [(r["patched"], r.get("why"), r.get("kernel")) for r in rows]  # before regions take sites in
    _take_in(all_sites, rows, [ok for ok, _, _ in own])
    _eager(all_sites, rows, own, classes)
    report["layers"] = rows
    report["served"], report["unserved"] = _served(all_sites, rows, dtype, p)
    report["served_eager"] = {k: [r["layer"] for r in rows if r["eager"] and r.get("eager_kernel") == k]
                              for k in report["served"]}
    report["unserved"] = [k for k in report["unserved"] if not report["served_eager"][k]]  # in neither mode
    return report


def _take_in(all_sites: list[Site], rows: list[dict], own: list[bool]) -> None:
    """Compiled mode (vLLM's default; the fusion pass serves every kind): a site inside a larger site
    served by its own kernel runs in that kernel (larger regions come first; `inside` names it)."""
    taken: list[Site] = []
    for s, r, has in zip(all_sites, rows, own):
        inside = next((t for t in taken if s.modules < t.modules), None)
        if inside is not None:
            r.update(patched=True, inside=inside.layer, why=f"runs inside its layer's {inside.op} kernel ({inside.layer})")
            r.pop("buckets", None)
            r.pop("kernel", None)
        elif has:
            taken.append(s)


def _eager(all_sites: list[Site], rows: list[dict], own: list[tuple[bool, str | None, str | None]],
           classes: dict[str, str]) -> None:
    """Eager mode (`enforce_eager`, no fusion pass): each row's `eager` (served then) and either
    `eager_kernel` (the kind whose own kernel runs it) or `eager_why` (the larger region's kernel that
    runs it, or why eager mode does not serve it). The single ops are served wherever vLLM
    runs them; a whole region only in instances of the classes the eager hooks patch, Gemma's norm
    and region kinds and the biased projections (hook "pattern") never."""
    taken: list[Site] = []
    kernel_of: dict[Site, str] = {}
    for s, r, (has, why, kernel) in zip(all_sites, rows, own):
        inside = next((t for t in taken if s.modules < t.modules), None)
        # the rule of the kind whose kernel serves it (a plain norm kernel takes a float32 Gemma norm)
        rule = _eager_rule(Site(s.layer, kernel or s.op, s.dim, s.eps, s.note, s.spans), classes) if has else why
        if inside is not None:
            r.update(eager=True, eager_why=f"runs inside its layer's {kernel_of[inside]} kernel ({inside.layer})")
        elif rule is None:
            kernel_of[s] = kernel or s.op
            r.update(eager=True, eager_kernel=kernel_of[s])
            taken.append(s)
        else:
            r.update(eager=False, eager_why=rule)


def _eager_rule(s: Site, classes: dict[str, str]) -> str | None:
    """Why eager mode would not run this site's own kernel (None: it would)."""
    from prism_serve.region_table import Site as RegionSite, eager_served, owner

    site = RegionSite(s.op, s.modules)
    if eager_served(site, classes):
        return None
    kind = KINDS[s.op]
    if kind.hook == "pattern":
        return f"{s.op} is served in compiled mode only (the fusion pass); eager mode runs vLLM's path"
    where = owner(site)
    return (f"eager mode serves {s.op} in {', '.join(sorted(kind.eager_classes))} instances only; "
            f"{where or 'its module'} is {classes.get(where) or 'of a class the capture did not record'}")


def _served(all_sites: list[Site], rows: list[dict], dtype: str, p) -> tuple[dict, list]:
    """Region kind -> the layers it serves, for every kind the table has a kernel for at one of the
    model's sizes; and the kinds among them that serve no layer."""
    if p.table is None:
        return {}, []
    want = TORCH_DTYPES.get(dtype)
    # a residual add + RMSNorm + projection runs its plain form's kernel where it has none of its own
    plain = {s: KINDS[s.op].without_residual for s in all_sites
             if s.op in KINDS and KINDS[s.op].form.projection and KINDS[s.op].form.norm == "rms"}
    keys = {(s.op, s.dim, s.eps) for s in all_sites} | {(k.name, s.dim, s.eps) for s, k in plain.items() if k}
    stored = sorted({op for op, per in p.table.ops.items() for (dt, dim, eps) in per
                     if dt == want and (op, dim, eps) in keys})
    served = {op: [r["layer"] for r in rows if r.get("kernel") == op] for op in stored}
    return served, [op for op, layers in served.items() if not layers]


SAFETENSORS_DTYPES = MappingProxyType({"F32": "float32", "F16": "float16", "BF16": "bfloat16"})


def serving_dtype(model_dtype: str) -> str:
    """The dtype vLLM's `dtype="auto"` runs a model of `model_dtype` in: its own, but float32 is
    downcast to the platform's first supported dtype (bfloat16; float16 on a GPU without bfloat16)."""
    if model_dtype != "float32":
        return model_dtype
    import torch

    return "float16" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bfloat16"


def _dtype(cfg: dict, path: Path) -> str:
    """The model's own dtype, which vLLM's `dtype="auto"` starts from: config.json's, else the weights'
    own (the floating dtype most of their elements have, read from the safetensors headers), else float16."""
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or _weights_dtype(path) or "float16").replace("torch.", "")


def _never(s: Site, dtype: str, quant: dict | None, lora: bool) -> str | None:
    """Why the plugin would never serve this site, whatever the registry holds; None if it could."""
    if s.op not in KINDS or s.note.startswith("unsupported: "):
        return s.note.removeprefix("unsupported: ") or f"{s.op}: no region kind of prism's"
    if dtype not in TORCH_DTYPES:
        return f"unsupported dtype {dtype}: prism's kernels are {', '.join(TORCH_DTYPES)} only"
    if not KINDS[s.op].form.projection:
        return None
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        return (f"quantized weight ({method}): the projection's weight is not in the activation dtype, so "
                f"{s.op} is never matched (its norm and activation still are)")
    if lora:
        return f"LoRA: adapters wrap the projection, so {s.op} is never matched (its norm and activation still are)"
    return None


def _weights_dtype(path: Path) -> str | None:
    """The floating dtype holding most weight elements of the model's safetensors files, if any."""
    count: dict[str, int] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size <= 100 << 20:
                    continue
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            continue
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict) or t.get("dtype") not in SAFETENSORS_DTYPES:
                continue
            n = 1
            for d in t.get("shape") or []:
                n *= int(d)
            count[SAFETENSORS_DTYPES[t["dtype"]]] = count.get(SAFETENSORS_DTYPES[t["dtype"]], 0) + n
    return max(count, key=count.get) if count else None


def _explain(s: Site, dtype: str, p, url: str, device, never: str | None, model: str) -> dict:
    row = {"layer": s.layer, "op": s.op, "pattern": " -> ".join(KINDS[s.op].vllm_path) if s.op in KINDS else "",
           "dim": s.dim, "patched": False}
    if s.note and never is None:
        row["note"] = s.note
    if never is not None:
        row["why"] = never
        return row
    kernel, entry = _kernel(s, TORCH_DTYPES[dtype], p.table) if p.table is not None else (s.op, None)
    if entry is not None:
        row.update(patched=True, kernel=kernel)
        row["buckets"] = [f"{lo}-{hi}: kernel {lz.kernel_id}" for lo, hi, lz in zip(entry.los, entry.his,
                                                                                  entry.launchers)]
        row["why"] = "kernels for every num_tokens in these buckets; other sizes run vLLM's own path"
        own = KINDS[s.op].form
        if own.norm == "gemma" and KINDS[kernel].form == replace(own, norm="rms"):  # a plain norm kernel on Gemma's computed weight
            row["why"] += (f"; vLLM's RMSNorm op on the float32 w + 1 goes to prism's IR provider, whose {kernel} "
                           "kernel runs it")
        elif kernel != s.op:
            row["why"] += f"; the residual is added before the {kernel} kernel"
        return row
    if p.state != "ready" and p.message:
        row["why"] = p.message.removeprefix("prism-serve: ")
        return row
    row["why"] = _why_not(s, dtype, url, device, p)
    gap = mismatch(s.op, (TORCH_DTYPES[dtype], s.dim, s.eps), p.table.ops.get(s.op, {}), model) if p.table else None
    if gap is not None:  # the kernels this device has for the kind are for another dtype or size
        row["why"] += f"; {gap}"
    return row


def _kernel(s: Site, dtype, table) -> tuple[str, object]:
    """(the kind whose kernel serves the site, its buckets) where the table has one, else (s.op, None).
    In float32 a Gemma norm is vLLM's RMSNorm op on the computed w + 1, of x's dtype: a plain norm
    kernel for that key takes it first (the IR provider, as Dynamo traces), before Gemma's own.
    A residual add + norm + projection without its own kernel runs its norm + projection kernel
    on the sum (the plugin adds the residual beside it)."""
    kind = KINDS[s.op]
    if kind.form.norm == "gemma" and not kind.form.projection and dtype == TORCH_DTYPES["float32"]:
        plain = kind_of(replace(kind.form, norm="rms")).name
        entry = table.entry(plain, dtype, s.dim, s.eps)
        if entry is not None:
            return plain, entry
    entry = table.entry(s.op, dtype, s.dim, s.eps)
    if entry is None and kind.form.projection and kind.without_residual is not None:
        plain = kind.without_residual.name
        return plain, table.entry(plain, dtype, s.dim, s.eps)
    return s.op, entry


def _status(status: str) -> str:
    if status == "verified":
        return "status verified: not measured faster than vLLM here (PRISM_SERVE_FORCE=1 uses it anyway)"
    return f"status {status}"


def _why_not(s: Site, dtype: str, url: str, device, p) -> str:
    """Why the registry has nothing usable for this site's exact program."""
    from prism_serve.registry.db import open_registry
    from prism_serve.registry.store import current_versions, incompatibility, list_kernels

    kind = KINDS[s.op]
    prog = kind.program(dict(zip(kind.key_names, s.dim if isinstance(s.dim, tuple) else (s.dim,))),
                        dtype, s.eps)
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
    table = Table("layer", "op", "compiled", "eager", "kernels / why not", title=title)
    for row in report["layers"]:
        detail = ", ".join(row["buckets"]) if row.get("buckets") else row.get("why", "")
        if row["patched"] and not row["eager"]:
            detail += f"; eager: {row['eager_why']}"
        table.add_row(row["layer"], row["op"], "yes" if row["patched"] else "no", "yes" if row["eager"] else "no",
                      detail)
    console.print(table)
    console.print(f"registry: {report['registry']}" + (f" — {report['message']}" if report["message"] else ""))
    if report.get("sites_from"):
        console.print(f"sites from {report['sites_from']}")
    for kind, layers in report["served"].items():
        eager = report["served_eager"].get(kind, [])
        console.print(f"{kind}: " + (f"serves {', '.join(layers)}" if layers else
                                     "stored for this model's sizes, but serves no layer")
                      + ("" if eager == layers else f"; in eager mode {', '.join(eager) or 'none'}"))
    if report["skipped"]:
        console.print("skipped kernels: " + "; ".join(f"{why} ({n})" for why, n in report["skipped"].items()))
