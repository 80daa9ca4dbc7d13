"""Capture a model: run the child process, turn its region instances into Programs, merge, rank.

`capture(model)` is the library entry point. It validates the model directory,
runs `prism_serve.capture.child` in a fresh interpreter (vLLM rebinds torch
threads and cores for its whole process), builds each supported region's
Program with the optimizer's own builders (so canonical hashes match), merges
identical regions across layers and attaches time shares and num_tokens buckets. Which
kinds have a Program is `prism_serve.region_table`'s.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prism_serve.capture.embedded import resolve_model
from prism_serve.errors import PrismError
from prism_serve.optimize.ir.program import Program
from prism_serve.region_table import KINDS

log = logging.getLogger(__name__)
CHILD_TIMEOUT_S = 300



class CaptureError(PrismError):
    """The model could not be captured: bad path, bad config, or vLLM refused it."""


@dataclass
class Instance:
    """One region at one site (a layer's modules), with its recorded tensors.

    A supported region's inputs are in its Program's signature order; an unsupported
    one's (rotary, attention) are the vLLM op's own tensor arguments, kept so tests can
    check the reported dims against an independent reference."""

    kind: str
    layer: int | None
    modules: list[str]
    dims: dict
    eps: float | None
    dtype: str
    supported: bool
    reason: str | None
    program: Program | None = None
    # one (num_tokens, inputs in Program signature order, outputs) per recorded forward
    recordings: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    time_us: float = 0.0
    rows_per_token: int = 1  # q/k norm run once per (token, head): the Program's num_tokens is tokens * heads

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The first recorded forward's inputs (the prefill)."""
        return self.recordings[0][1] if self.recordings else []

    @property
    def outputs(self) -> list[torch.Tensor]:
        return self.recordings[0][2] if self.recordings else []


@dataclass
class Region:
    """Identical instances merged across layers."""

    kind: str
    program: Program | None
    dims: dict
    eps: float | None
    dtype: str
    supported: bool
    reason: str | None
    layers: list[int]
    modules: list[str]
    time_share: float
    buckets: list[int]
    rows_per_token: list[int] = field(default_factory=list)
    # attention only: per forward, its sequences and longest query / kv ({"batch", "q_len", "kv_len", "count"})
    shapes: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"kind": self.kind, "program_hash": self.program.canonical_hash if self.program else None,
                "program": self.program.to_json() if self.program else None, "dims": self.dims, "eps": self.eps,
                "dtype": self.dtype, "supported": self.supported, "reason": self.reason, "layers": self.layers,
                "modules": self.modules, "time_share": self.time_share, "buckets": self.buckets,
                "rows_per_token": self.rows_per_token, "shapes": self.shapes}


@dataclass
class CaptureResult:
    model: str
    architecture: str
    load_format: str
    regions: list[Region]
    instances: list[Instance]
    num_tokens: dict[int, int]
    buckets: list[int]
    recorded_num_tokens: list[int]
    seconds: float
    attention_shapes: list[dict] = field(default_factory=list)
    runner: str = "generate"  # vLLM's runner for the model: "generate", or "pooling" (no prism target)
    classes: dict[str, str] = field(default_factory=dict)  # module path -> its class name, every level
    dtype: str = ""  # the dtype vLLM ran the model in

    def to_json(self) -> dict:
        return {"model": self.model, "architecture": self.architecture, "load_format": self.load_format,
                "runner": self.runner, "dtype": self.dtype,
                "num_tokens_histogram": {str(k): v for k, v in self.num_tokens.items()}, "buckets": self.buckets,
                "attention_shapes": self.attention_shapes, "regions": [r.to_json() for r in self.regions],
                "classes": self.classes}


def buckets_from_histogram(hist: dict[int, int]) -> list[int]:
    """Power-of-two shape buckets covering every num_tokens seen (each n goes to the next 2^k >= n)."""
    return sorted({1 << max(0, (n - 1).bit_length()) for n in hist if n > 0})


def _validate(model_dir: Path) -> None:
    if not model_dir.exists():
        raise CaptureError(f"model path {model_dir} does not exist")
    if not model_dir.is_dir():
        raise CaptureError(f"model path {model_dir} is not a directory")
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise CaptureError(f"{model_dir} has no config.json")
    try:
        data = json.loads(cfg.read_text())
    except ValueError as exc:
        raise CaptureError(f"{cfg} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CaptureError(f"{cfg} must hold a JSON object")


def _run_child(model_dir: Path, out: Path, dtype: str) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "prism_serve.capture.child", str(model_dir), str(out), dtype]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CaptureError(f"capture of {model_dir} did not finish within {CHILD_TIMEOUT_S} s") from None
    result_file = out / "result.json"
    if not result_file.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise CaptureError(f"capture process exited with {proc.returncode}: {tail[0]}")
    result = json.loads(result_file.read_text())
    if not result.get("ok"):
        raise CaptureError(result.get("error", "capture failed"))
    log.debug("capture child took %.1f s", result.get("seconds", 0.0))
    return result


def _program(kind: str, dims: dict, dtype: str, eps: float | None) -> Program | None:
    k = KINDS.get(kind)
    return k.program(dims, dtype, eps) if k else None


def _instances(result: dict, record: dict) -> list[Instance]:
    times = result["module_time_us"]
    recorded, weights = record["recorded"], record["weights"]
    out = []
    for i, r in enumerate(result["regions"]):
        dims = dict(r["dims"])
        rows = int(dims.pop("rows_per_token", 1))
        inst = Instance(r["kind"], r["layer"], r["modules"], dims, r["eps"], r["dtype"], r["supported"],
                        r["reason"], time_us=sum(times.get(m, 0.0) for m in r["modules"]), rows_per_token=rows)
        if inst.supported:
            try:
                inst.program = _program(inst.kind, inst.dims, inst.dtype, inst.eps)
            except (PrismError, KeyError, TypeError) as exc:  # dims the builder rejects: report, never crash
                inst.supported, inst.reason = False, f"the {inst.kind} builder rejected dims {inst.dims}: {exc}"
            else:
                if inst.program is None:
                    inst.supported, inst.reason = False, f"no Program builder for region kind {inst.kind!r}"
        for n, forward in recorded:
            if i not in forward:
                continue
            inputs = []
            for ref, value in zip(r["inputs"], forward[i]["inputs"]):
                if "param" in ref:
                    value = weights.get(ref["param"])
                    if value is not None and "span" in ref:
                        value = value[ref["span"][0]:ref["span"][1]].contiguous()
                    if value is not None and "shape" in ref:  # the experts' stacked weights, as the Program takes them
                        value = value.reshape(ref["shape"])
                inputs.append(_rows(value) if inst.supported and not {"param", "shape"} & set(ref) else value)
            outputs = [_rows(v) if inst.supported and "shape" not in ref else v
                       for ref, v in zip(r["outputs"], forward[i]["outputs"])]
            inst.recordings.append((n, inputs, outputs))
        out.append(inst)
    return out


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """An activation as the Programs take it, (rows, features): vLLM's Transformers backend
    keeps a leading batch dim, (1, tokens, features)."""
    return t.reshape(-1, t.shape[-1]) if t is not None and t.dim() > 2 else t


def _merge(instances: list[Instance], total_us: float, hist: dict[int, int],
           attention_shapes: list[dict]) -> list[Region]:
    merged: dict[tuple, Region] = {}
    for inst in instances:
        key = (inst.kind, inst.program.canonical_hash if inst.program else json.dumps(inst.dims, sort_keys=True))
        share = inst.time_us / total_us if total_us > 0 else 0.0
        if key not in merged:
            merged[key] = Region(inst.kind, inst.program, inst.dims, inst.eps, inst.dtype, inst.supported,
                                 inst.reason, [], [], 0.0, [])
        reg = merged[key]
        if inst.layer is not None and inst.layer not in reg.layers:
            reg.layers.append(inst.layer)
        reg.modules.append("+".join(inst.modules))
        reg.time_share += share
        if inst.rows_per_token not in reg.rows_per_token:
            reg.rows_per_token.append(inst.rows_per_token)
    for reg in merged.values():
        reg.rows_per_token.sort()
        if reg.dims:  # a Program's num_tokens is rows: tokens * rows_per_token
            reg.buckets = buckets_from_histogram({n * r: c for n, c in hist.items() for r in reg.rows_per_token})
        if reg.kind == "attention":
            reg.shapes = attention_shapes
    return sorted(merged.values(), key=lambda r: (not r.supported, -r.time_share))


DTYPES = ("auto", "float32", "bfloat16", "float16")


def capture(model: str | Path | None = None, dtype: str = "auto") -> CaptureResult:
    """Capture `model` (a directory, an embedded model name, or None for the default embedded one)
    as vLLM runs it in `dtype` (vLLM's `dtype`: "auto", vLLM's choice, is what `vllm serve` runs;
    it runs a float32 checkpoint in bfloat16). The regions' Programs are in the dtype vLLM ran."""
    if dtype not in DTYPES:
        raise CaptureError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    model_dir = resolve_model(model)
    _validate(model_dir)
    with tempfile.TemporaryDirectory(prefix="prism-capture-") as tmp:
        out = Path(tmp)
        result = _run_child(model_dir, out, dtype)
        record = torch.load(out / "record.pt", weights_only=True)
    hist = {int(k): v for k, v in result["num_tokens"].items()}
    buckets = buckets_from_histogram(hist)
    shapes = [{"batch": b, "q_len": q, "kv_len": kv, "count": c} for b, q, kv, c in result["attention_shapes"]]
    instances = _instances(result, record)
    regions = _merge(instances, result["forward_time_us"], hist, shapes)
    return CaptureResult(str(model) if model is not None else str(model_dir), result["architecture"],
                         result["load_format"], regions, instances, hist, buckets,
                         result["recorded_num_tokens"], result["seconds"], shapes, result.get("runner", "generate"),
                         result.get("classes", {}), result.get("dtype", ""))
