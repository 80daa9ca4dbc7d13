"""The runtime dispatch table: registry kernels turned into launchers, keyed by op and shape.

Built once at startup from the registry rows of this device (`build_table`). At serve time
`Table.pick(op, dtype, dim, eps, rows)` is a dict lookup and a bisect over sorted, disjoint
num_tokens intervals: no database, no codegen, no autotuning, no host sync.

Which ops and regions can be replaced is the region table's (`prism_serve.region_table.KINDS`):
each kind names the Program builder whose canonical hash a stored kernel must match exactly, so a
kernel is only ever used for the very semantics it was verified against (vLLM's op or region with
these sizes, dtype and epsilon).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from prism_serve.region_table import KINDS

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Kernels of a CPU registry are instantiated against a GPU spec only to bound their tile sizes;
# the interpreter has no limits of its own, and warmup instantiates CPU kernels the same way.
CPU_BOUNDS_GPU = "h100"


@dataclass
class Launcher:
    """One compiled kernel for a num_tokens interval."""

    run: Callable
    kernel_id: int
    lo: int
    hi: int
    measured_us: float | None = None  # on this device
    modeled_us: float | None = None


@dataclass
class Buckets:
    """Disjoint, sorted num_tokens intervals of one (op, dtype, dim, eps), each with its launcher."""

    los: list[int] = field(default_factory=list)
    his: list[int] = field(default_factory=list)
    launchers: list[Launcher] = field(default_factory=list)

    def pick(self, rows: int) -> Launcher | None:
        i = bisect.bisect_right(self.los, rows) - 1
        if i >= 0 and rows <= self.his[i]:
            return self.launchers[i]
        return None


def _best_time(lz: Launcher) -> tuple[int, float, int]:
    """Measured kernels first, by measured time; then modeled-only ones, by modeled time: a measured
    and a modeled time are never compared with each other."""
    if lz.measured_us is not None:
        return (0, lz.measured_us, lz.kernel_id)
    return (1, lz.modeled_us if lz.modeled_us is not None else float("inf"), lz.kernel_id)


def disjoint(candidates: Iterable[Launcher]) -> Buckets:
    """Cut overlapping buckets into disjoint intervals, each served by its fastest covering kernel."""
    cands = list(candidates)
    cuts = sorted({c.lo for c in cands} | {c.hi + 1 for c in cands})
    out = Buckets()
    for a, b in itertools.pairwise(cuts):
        cover = [c for c in cands if c.lo <= a and b - 1 <= c.hi]
        if not cover:
            continue
        best = min(cover, key=_best_time)
        if out.launchers and out.launchers[-1] is best and out.his[-1] == a - 1:
            out.his[-1] = b - 1
            continue
        out.los.append(a)
        out.his.append(b - 1)
        out.launchers.append(best)
    return out


@dataclass
class Table:
    """Per op: (torch dtype, dim, eps) -> buckets. Plus what was skipped and why."""

    device: str  # the torch device type the kernels run on ("cpu", "cuda")
    ops: dict[str, dict[tuple, Buckets]] = field(default_factory=dict)
    skipped: list[tuple[int | None, str]] = field(default_factory=list)  # (kernel id, reason)

    def entry(self, op: str, dtype: torch.dtype, dim: int, eps: float | None = None) -> Buckets | None:
        per_op = self.ops.get(op)
        return per_op.get((dtype, dim, eps)) if per_op else None

    def kernels(self, ops=None) -> int:
        """Distinct kernels, of every op or of `ops` only."""
        return len({lz.kernel_id for op, per in self.ops.items() if ops is None or op in ops
                    for b in per.values() for lz in b.launchers})

    def summary(self) -> dict[str, int]:
        """op -> number of (dtype, dim, eps) keys it serves."""
        return {op: len(per) for op, per in self.ops.items() if per}


def build_table(kernels, device_type: str, spec=None, compile_fn: Callable | None = None) -> Table:
    """Compile every usable registry kernel (a `Kernel` row) into the dispatch table.

    A kernel that is not one of the region table's exact programs, cannot be instantiated or fails to
    compile is skipped with its reason; nothing here raises for a bad kernel."""
    from prism_serve.optimize.codegen import compile_instance
    from prism_serve.optimize.gpus import get_gpu
    from prism_serve.registry.store import kernel_instance

    compile_fn = compile_fn or compile_instance
    if spec is None and device_type == "cpu":
        spec = get_gpu(CPU_BOUNDS_GPU)
    table = Table(device_type)
    found: dict[str, dict[tuple, list[Launcher]]] = {}
    compiled: dict[tuple, Callable] = {}  # (sGraph hash, params) -> launcher, shared across buckets
    for k in kernels:
        try:
            cache_key = (k.sgraph.hash, k.params_json)
            inst = None
            if cache_key not in compiled:
                inst = kernel_instance(k, spec)
            prog = inst.sgraph.program if inst is not None else compiled[cache_key][1]
            op = KINDS.get(prog.name)
            key = op.key_of(prog) if op else None
            if key is None:
                table.skipped.append((k.id, f"program {prog.name!r} is not one prism can patch into vLLM"))
                continue
            if key[0] != k.dtype:
                table.skipped.append((k.id, f"stored dtype {k.dtype} differs from its program's {key[0]}"))
                continue
            if cache_key not in compiled:
                compiled[cache_key] = (compile_fn(inst), prog)
        except Exception as exc:  # noqa: BLE001 - one bad kernel must not stop the others
            table.skipped.append((k.id, f"failed to compile: {_one_line(exc)}"))
            continue
        tkey = (TORCH_DTYPES[key[0]], key[1], key[2])
        found.setdefault(op.name, {}).setdefault(tkey, []).append(
            Launcher(compiled[cache_key][0], k.id, k.bucket_lo, k.bucket_hi, k.measured_us, k.modeled_us))
    for name, per in found.items():
        table.ops[name] = {key: disjoint(cands) for key, cands in per.items()}
    return table


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
