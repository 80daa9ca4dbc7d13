"""Portable JSON export and validated, atomic import.

An export is untrusted data. Every record is parsed into typed values before anything is
written (`optimize.schema` for the IR and the sGraph, the field table below for the rest):
strict JSON (no duplicate keys, no NaN / Infinity, bounded integers and nesting), no unknown
fields, ints within the columns' ranges, names and versions from small grammars, text without
control characters, the program hash checked against its IR, and no record twice. Import then
re-verifies what it brings in (`registry.gate`) and writes it all in one transaction, or none.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from prism_serve.errors import PrismError
from prism_serve.optimize.ir import schema as T
from prism_serve.optimize.ir.program import DTYPES
from prism_serve.optimize.target.gpus import GPU_NAME, GpuSpec
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.models import DEVICE_KINDS, STATUSES
from prism_serve.registry.store import (
    DeviceInfo,
    KernelResult,
    Versions,
    add_kernel,
    canonical_json,
    check_result,
    list_kernels,
)

FORMAT = "prism-serve-registry"
EXPORT_VERSION = 1
MAX_EXPORT_BYTES = 1 << 28
MAX_RECORDS = 100_000
MAX_TOKENS = 2**31 - 1  # the bucket columns are 32-bit
MAX_US = 1e12
HASH = re.compile(r"[0-9a-f]{16,64}")
CAPABILITY = re.compile(r"[0-9]{1,2}\.[0-9]{1,2}")
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+\-]{0,39}")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")
E = RegistryError

RECORD_FIELDS = ("program", "sgraph", "device", "dtype", "bucket", "params", "versions", "status", "reason")
OPTIONAL_FIELDS = ("modeled_us", "measured_us", "baseline", "baseline_us", "baseline_modeled_us", "modeled_speedup")


def free_text(value: Any, limit: int, where: str) -> str:
    """Free text (a reason, a model or layer path): a string without control characters."""
    if type(value) is not str or len(value) > limit or CONTROL.search(value):
        raise E(f"{where} must be text of at most {limit} characters without control characters, "
                f"got {value!r:.60}")
    return value


def matching(value: Any, pattern: re.Pattern, where: str) -> str:
    if type(value) is not str or not pattern.fullmatch(value):
        raise E(f"{where} must match {pattern.pattern}, got {value!r:.60}")
    return value


def _optional(value: Any, check, *args) -> Any:
    return None if value is None else check(value, *args)


def _device(d: Any, where: str) -> DeviceInfo:
    T.fields(d, ("kind", "name"), ("compute_capability", "sm_count", "memory_bytes", "spec"), where, E)
    device = DeviceInfo(T.one_of(d["kind"], DEVICE_KINDS, f"{where}.kind", E),
                        matching(d["name"], GPU_NAME, f"{where}.name"),
                        _optional(d.get("compute_capability"), matching, CAPABILITY, f"{where}.compute_capability"),
                        _optional(d.get("sm_count"), T.int_in, 1, 100_000, f"{where}.sm_count", E),
                        _optional(d.get("memory_bytes"), T.int_in, 0, 2**50, f"{where}.memory_bytes", E))
    if d.get("spec") is None:
        return device
    try:
        spec = GpuSpec.from_json(d["spec"]) if isinstance(d["spec"], dict) else None
    except PrismError as exc:
        raise E(f"{where}.spec: {exc}") from None
    if spec is None or DeviceInfo.from_spec(spec).fingerprint != device.fingerprint:
        raise E(f"{where}.spec must be the measured spec of {device.fingerprint}")
    return dataclasses.replace(device, spec=spec)


def _versions(v: Any, where: str) -> Versions:
    T.fields(v, ("torch", "triton", "prism", "codegen"), ("vllm",), where, E)
    return Versions(*(matching(v[k], VERSION, f"{where}.{k}") for k in ("torch", "triton")),
                    _optional(v.get("vllm"), matching, VERSION, f"{where}.vllm"),
                    matching(v["prism"], VERSION, f"{where}.prism"),
                    T.int_in(v["codegen"], 0, 10**6, f"{where}.codegen", E))


def _sources(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    out = []
    for s in T.listed(value, 0, 10_000, where, E):
        if type(s) is not list or len(s) != 2:
            raise E(f"{where}: must be a list of [model, layer path] pairs, got {s!r:.60}")
        out.append((free_text(s[0], 300, f"{where} model"), free_text(s[1], 300, f"{where} layer path")))
    return tuple(dict.fromkeys(out))


def record_to_result(rec: Any, where: str) -> KernelResult:
    """Parse one export record into typed values and a KernelResult (as claimed: the gate then
    re-verifies it and decides its status)."""
    T.fields(rec, RECORD_FIELDS, OPTIONAL_FIELDS, where, E)
    prog, sg = rec["program"], rec["sgraph"]
    T.fields(prog, ("hash", "ir", "sources"), (), f"{where}.program", E)
    T.fields(sg, ("json", "proof", "tests"), (), f"{where}.sgraph", E)
    for key in ("proof", "tests"):  # claims: replaced by the gate's own findings
        if not isinstance(sg[key], dict):
            raise E(f"{where}.sgraph.{key} must be an object")
    bucket = T.listed(rec["bucket"], 2, 2, f"{where}.bucket", E)
    lo, hi = (T.int_in(b, 1, MAX_TOKENS, f"{where}.bucket", E) for b in bucket)
    if lo > hi:
        raise E(f"{where}.bucket: [{lo}, {hi}] must have lo <= hi")
    for key in ("modeled_us", "measured_us", "baseline_us", "baseline_modeled_us"):
        _optional(rec.get(key), T.float_in, 0.0, MAX_US, f"{where}.{key}", E)
    _optional(rec.get("modeled_speedup"), T.float_in, 0.0, MAX_US, f"{where}.modeled_speedup", E)
    try:
        program = T.program_from_json(prog["ir"])
        sgraph = T.sgraph_from_json(sg["json"])
    except PrismError as exc:
        raise E(f"{where}: {exc}") from None
    stated = matching(prog["hash"], HASH, f"{where}.program.hash")
    if program.canonical_hash != stated:
        raise E(f"{where}.program.hash: {stated!r} is not the hash of its IR ({program.canonical_hash})")
    result = KernelResult(
        program=program, sgraph=sgraph, device=_device(rec["device"], f"{where}.device"),
        dtype=T.one_of(rec["dtype"], DTYPES, f"{where}.dtype", E), bucket=(lo, hi),
        params=T.params_from_json(rec["params"], f"{where}.params", E),
        versions=_versions(rec["versions"], f"{where}.versions"),
        status=T.one_of(rec["status"], STATUSES, f"{where}.status", E),
        reason=free_text(rec["reason"], 1000, f"{where}.reason"),
        modeled_us=rec.get("modeled_us"), measured_us=rec.get("measured_us"),
        baseline=_optional(rec.get("baseline"), T.name, f"{where}.baseline", E), baseline_us=rec.get("baseline_us"),
        baseline_modeled_us=rec.get("baseline_modeled_us") or None, modeled_speedup=rec.get("modeled_speedup") or None,
        proof=sg["proof"], tests=sg["tests"], sources=_sources(prog["sources"], f"{where}.program.sources"))
    try:
        check_result(result)
    except RegistryError as exc:
        raise E(f"{where}: {exc}") from None
    return result


def record_key(r: KernelResult) -> tuple:
    """What makes two records the same kernel (the registry's unique key)."""
    return (r.program.canonical_hash, canonical_json(r.sgraph.to_json()), r.device.fingerprint, r.dtype, r.bucket,
            canonical_json(r.params))


def parse_export(data: Any) -> list[KernelResult]:
    """Validate a whole export document (text or parsed); raises on the first bad record, naming it."""
    if isinstance(data, (str, bytes)):
        data = T.loads(data, RegistryError, "export file")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise E(f"not a prism-serve registry export (expected \"format\": {FORMAT!r})")
    version = data.get("export_version")
    if version != EXPORT_VERSION or type(version) is not int:
        raise E(f"export has export_version {version!r:.40}; this prism-serve reads version {EXPORT_VERSION}")
    T.fields(data, ("format", "export_version", "records"), ("schema_revision",), "export", E)
    if not isinstance(data["records"], list):
        raise E("export: 'records' must be a list")
    records = T.listed(data["records"], 0, MAX_RECORDS, "export: 'records'", E)
    results, seen = [], {}
    for i, rec in enumerate(records):
        r = record_to_result(rec, f"record #{i}")
        key = record_key(r)
        if key in seen:
            raise E(f"record #{i} repeats record #{seen[key]} (same program, sGraph, device, dtype, bucket and "
                    f"params)")
        seen[key] = i
        results.append(r)
    return results


def kernel_record(k) -> dict[str, Any]:
    sources = [[s.model, s.layer_path] for s in k.program.sources]
    d = k.device
    stored = lambda text: T.loads(text, E, f"kernel {k.id}: stored JSON")  # noqa: E731
    return {
        "program": {"hash": k.program.hash, "ir": stored(k.program.ir_json), "sources": sources},
        "sgraph": {"json": stored(k.sgraph.sgraph_json), "proof": k.sgraph.proof, "tests": k.sgraph.tests},
        "device": {"kind": d.kind, "name": d.name, "compute_capability": d.compute_capability,
                   "sm_count": d.sm_count, "memory_bytes": d.memory_bytes}
                  | ({"spec": d.spec} if d.spec is not None else {}),
        "dtype": k.dtype, "bucket": [k.bucket_lo, k.bucket_hi], "params": stored(k.params_json),
        "versions": {"torch": k.torch_version, "triton": k.triton_version, "vllm": k.vllm_version,
                     "prism": k.prism_version, "codegen": k.codegen_version},
        "status": k.status, "reason": k.reason, "modeled_us": k.modeled_us, "measured_us": k.measured_us,
        "baseline": k.baseline, "baseline_us": k.baseline_us, "baseline_modeled_us": k.baseline_modeled_us,
        "modeled_speedup": k.modeled_speedup,
    }


def export_document(session: Session, **filters) -> dict[str, Any]:
    from prism_serve.registry.db import head_revision
    return {"format": FORMAT, "export_version": EXPORT_VERSION, "schema_revision": head_revision(),
            "records": [kernel_record(k) for k in list_kernels(session, **filters)]}


def export_file(session: Session, path: str | Path, **filters) -> int:
    doc = export_document(session, **filters)
    try:
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True))
    except OSError as exc:
        raise E(f"cannot write the export at {path}: {exc.strerror or exc}") from None
    return len(doc["records"])


def import_results(session: Session, results: list[KernelResult]) -> int:
    """Write validated results within the caller's transaction; a kernel the registry already holds
    is left as it is (an import never overwrites this device's own status or timings). Returns the
    number of kernels added."""
    ids: dict = {}
    return sum(add_kernel(session, r, ids, keep_existing=True) is not None for r in results)


def read_export(path: str | Path) -> list[KernelResult]:
    try:
        size = Path(path).stat().st_size
        if size > MAX_EXPORT_BYTES:
            raise E(f"export {path} is {size} bytes, over the {MAX_EXPORT_BYTES} this prism-serve reads")
        data = Path(path).read_bytes()
    except OSError as exc:
        raise E(f"cannot read export {path}: {exc}") from None
    return parse_export(data)


__all__ = [
    "EXPORT_VERSION",
    "FORMAT",
    "canonical_json",
    "export_document",
    "export_file",
    "import_results",
    "kernel_record",
    "parse_export",
    "read_export",
]
