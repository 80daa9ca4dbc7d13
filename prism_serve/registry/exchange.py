"""Portable JSON export and validated, atomic import.

An export is data only. Every record is checked before anything is written: its
fields and their types, the program hash against its IR, the sGraph against the
program, and every string of the IR and sGraph against a strict alphabet, so a
field carrying Python source (which sympy or the code generator might otherwise
evaluate or render) is refused. The import then runs as one transaction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from prism_serve.errors import PrismError
from prism_serve.optimize.ir import Program
from prism_serve.optimize.sgraph import SGraph
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.store import DeviceInfo, KernelResult, Versions, add_kernel, canonical_json, list_kernels

FORMAT = "prism-serve-registry"
EXPORT_VERSION = 1
# Names and dims in IR / sGraph JSON: identifiers, numbers and arithmetic, nothing else.
SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.+\-*/() ]{0,200}")
SAFE_TEXT = re.compile(r"[^\n\r\x00]{0,1000}")
CODE_HINTS = ("__", "import ", "lambda", "exec(", "eval(", "compile(", "open(", "getattr(")
NUMBER = (int, float)

RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "program": (dict,), "sgraph": (dict,), "device": (dict,), "dtype": (str,), "bucket": (list,),
    "params": (dict,), "versions": (dict,), "status": (str,), "reason": (str,),
}
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {
    "modeled_us": NUMBER, "measured_us": NUMBER, "baseline": (str,), "baseline_us": NUMBER,
}
PROGRAM_FIELDS = {"hash": (str,), "ir": (dict,), "sources": (list,)}
SGRAPH_FIELDS = {"json": (dict,), "proof": (dict,), "tests": (dict,)}
DEVICE_FIELDS = {"kind": (str,), "name": (str,)}
DEVICE_OPTIONAL = {"compute_capability": (str,), "sm_count": (int,), "memory_bytes": (int,)}
VERSION_FIELDS = {"torch": (str,), "triton": (str,), "prism": (str,), "codegen": (int,)}
VERSION_OPTIONAL = {"vllm": (str,)}


def _looks_like_code(text: str) -> bool:
    return any(h in text for h in CODE_HINTS)


def _fields(obj: dict, required: dict, optional: dict, where: str) -> None:
    for key, types in required.items():
        if key not in obj:
            raise RegistryError(f"{where}: missing field {key!r}")
    for key, types in (required | optional).items():
        value = obj.get(key)
        if key not in required and value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise RegistryError(f"{where}: field {key!r} must be {names}, got {type(value).__name__} {value!r:.60}")
    extra = set(obj) - set(required) - set(optional)
    if extra:
        raise RegistryError(f"{where}: unknown fields {sorted(extra)}")


def check_strings(data: Any, where: str, pattern: re.Pattern = SAFE_TOKEN) -> None:
    """Every string (keys included) under `data` must match `pattern` and not look like code."""
    if isinstance(data, str):
        if not pattern.fullmatch(data) or _looks_like_code(data):
            raise RegistryError(f"{where}: refusing string {data!r:.80}: only names, numbers and arithmetic "
                                f"are allowed here (the registry holds data, never code)")
    elif isinstance(data, dict):
        for key, value in data.items():
            check_strings(key, where, pattern)
            check_strings(value, where, pattern)
    elif isinstance(data, list):
        for value in data:
            check_strings(value, where, pattern)
    elif data is not None and not isinstance(data, (int, float, bool)):
        raise RegistryError(f"{where}: unexpected value of type {type(data).__name__}")


def check_sgraph_json(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: sGraph JSON must be an object")
    check_strings(data, f"{where}: sGraph")


def record_to_result(rec: Any, where: str) -> KernelResult:
    """Validate one export record completely and turn it into a KernelResult."""
    if not isinstance(rec, dict):
        raise RegistryError(f"{where}: must be an object, got {type(rec).__name__}")
    _fields(rec, RECORD_FIELDS, OPTIONAL_FIELDS, where)
    prog, sg, dev, ver = rec["program"], rec["sgraph"], rec["device"], rec["versions"]
    _fields(prog, PROGRAM_FIELDS, {}, f"{where}.program")
    _fields(sg, SGRAPH_FIELDS, {}, f"{where}.sgraph")
    _fields(dev, DEVICE_FIELDS, DEVICE_OPTIONAL, f"{where}.device")
    _fields(ver, VERSION_FIELDS, VERSION_OPTIONAL, f"{where}.versions")
    check_strings(prog["ir"], f"{where}.program.ir")
    check_sgraph_json(sg["json"], f"{where}.sgraph.json")
    check_strings(rec["params"], f"{where}.params")
    for key in ("dtype", "status", "baseline"):
        check_strings(rec.get(key), f"{where}.{key}")
    check_strings([dev, ver], f"{where}.device/versions")
    for key, text in (("reason", rec["reason"]), ("sources", prog["sources"])):
        check_strings(text, f"{where}.{key}", SAFE_TEXT)
    if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in prog["sources"]):
        raise RegistryError(f"{where}.program.sources: must be a list of [model, layer path] pairs")
    bucket = rec["bucket"]
    if len(bucket) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in bucket):
        raise RegistryError(f"{where}.bucket: must be [lo, hi] ints, got {bucket!r}")
    try:
        program = Program.from_json(prog["ir"])
        sgraph = SGraph.from_json(sg["json"])
    except PrismError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    if program.canonical_hash != prog["hash"]:
        raise RegistryError(f"{where}.program.hash: {prog['hash']!r} is not the hash of its IR "
                            f"({program.canonical_hash})")
    result = KernelResult(
        program=program, sgraph=sgraph, device=DeviceInfo(**dev), dtype=rec["dtype"], bucket=(bucket[0], bucket[1]),
        params=rec["params"], versions=Versions(**({"vllm": None} | ver)), status=rec["status"],
        reason=rec["reason"], modeled_us=rec.get("modeled_us"), measured_us=rec.get("measured_us"),
        baseline=rec.get("baseline"), baseline_us=rec.get("baseline_us"), proof=sg["proof"], tests=sg["tests"],
        sources=tuple((a, b) for a, b in prog["sources"]))
    from prism_serve.registry.store import check_result
    try:
        check_result(result)
    except RegistryError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    return result


def parse_export(data: Any) -> list[KernelResult]:
    """Validate a whole export document; raises on the first bad record, naming it."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise RegistryError(f"export file is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RegistryError(f"not a prism-serve registry export (expected \"format\": {FORMAT!r})")
    version = data.get("export_version")
    if version != EXPORT_VERSION:
        raise RegistryError(f"export has export_version {version!r}; this prism-serve reads version "
                            f"{EXPORT_VERSION}")
    records = data.get("records")
    if not isinstance(records, list):
        raise RegistryError("export: 'records' must be a list")
    return [record_to_result(rec, f"record #{i}") for i, rec in enumerate(records)]


def kernel_record(k) -> dict[str, Any]:
    sources = [[s.model, s.layer_path] for s in k.program.sources]
    d = k.device
    return {
        "program": {"hash": k.program.hash, "ir": json.loads(k.program.ir_json), "sources": sources},
        "sgraph": {"json": json.loads(k.sgraph.sgraph_json), "proof": k.sgraph.proof, "tests": k.sgraph.tests},
        "device": {"kind": d.kind, "name": d.name, "compute_capability": d.compute_capability,
                   "sm_count": d.sm_count, "memory_bytes": d.memory_bytes},
        "dtype": k.dtype, "bucket": [k.bucket_lo, k.bucket_hi], "params": json.loads(k.params_json),
        "versions": {"torch": k.torch_version, "triton": k.triton_version, "vllm": k.vllm_version,
                     "prism": k.prism_version, "codegen": k.codegen_version},
        "status": k.status, "reason": k.reason, "modeled_us": k.modeled_us, "measured_us": k.measured_us,
        "baseline": k.baseline, "baseline_us": k.baseline_us,
    }


def export_document(session: Session, **filters) -> dict[str, Any]:
    from prism_serve.registry.db import head_revision
    return {"format": FORMAT, "export_version": EXPORT_VERSION, "schema_revision": head_revision(),
            "records": [kernel_record(k) for k in list_kernels(session, **filters)]}


def export_file(session: Session, path: str | Path, **filters) -> int:
    doc = export_document(session, **filters)
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True))
    return len(doc["records"])


def import_results(session: Session, results: list[KernelResult]) -> int:
    """Write validated results within the caller's transaction."""
    ids: dict = {}
    for r in results:
        add_kernel(session, r, ids)
    return len(results)


def read_export(path: str | Path) -> list[KernelResult]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"cannot read export {path}: {exc}") from None
    return parse_export(text)


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
