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
from types import MappingProxyType

import torch

from prism_serve.region_table import KINDS

log = logging.getLogger(__name__)

TORCH_DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})
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
    refused: list[tuple[int, str]] = field(default_factory=list)  # kernels whose load failed, and why

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


# A kernel's load at start-up (decode, instantiate, render and import its Triton source) took
# 10-50 ms on this project's 2-core CPU machine, 0.7 s for a child's first one (cold imports).
# A row that takes over ten times that is not one warmup wrote: it is refused rather than let
# it hold vLLM's start-up (see `bounded`).
LOAD_TIMEOUT_S = 10.0
# All kernels together: a registry's few hundred distinct kernels load in seconds; rows that each
# stay just under the bound must not add up to an endless start-up.
LOAD_BUDGET_S = 120.0


def build_table(kernels, device_type: str, spec=None, timeout_s: float = LOAD_TIMEOUT_S,
                budget_s: float = LOAD_BUDGET_S) -> Table:
    """Compile every usable registry kernel (a `Kernel` row) into the dispatch table.

    Each distinct (sGraph, params) is first loaded in a child process bounded in time and memory
    (`bounded.run_each`); only what loaded cleanly there is imported here. A kernel that is not
    one of the region table's exact programs is skipped; one whose load raised anything (SystemExit too),
    ended the child or overran `timeout_s` (or came after `budget_s` in all) is refused, with its
    reason. Nothing here raises for a bad kernel, and only KeyboardInterrupt gets through."""
    from prism_serve.optimize.target.gpus import get_gpu
    from prism_serve.patch.bounded import run_each

    if spec is None and device_type == "cpu":
        spec = get_gpu(CPU_BOUNDS_GPU)
    kernels = list(kernels)
    groups: dict[tuple, list] = {}  # (sGraph hash, params) -> its kernels: one load for all buckets
    for k in kernels:
        groups.setdefault((k.sgraph.hash, k.params_json), []).append(k)
    firsts = [ks[0] for ks in groups.values()]
    outcomes = run_each(lambda k: _prepare(k, spec), firsts, timeout_s, budget_s)
    table = Table(device_type)
    found: dict[str, dict[tuple, list[Launcher]]] = {}
    for ks, outcome in zip(groups.values(), outcomes):
        got = outcome.value
        try:
            if outcome.error is not None:
                raise KernelRefused(outcome.error)
            if not isinstance(got, dict):
                raise KernelRefused("its load answered something that is not an object")
            if "skip" in got:
                table.skipped += [(k.id, str(got["skip"])) for k in ks]
                continue
            run = _import(got)
            key = (TORCH_DTYPES[got["dtype"]], _dim(got["dim"]), got["eps"])
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever a row makes happen, serving goes on
            why = str(exc) if isinstance(exc, KernelRefused) else _one_line(exc)
            table.refused += [(k.id, why) for k in ks]
            table.skipped += [(k.id, f"failed to load: {why}") for k in ks]
            continue
        for k in ks:
            if got["dtype"] != k.dtype:
                table.skipped.append((k.id, f"stored dtype {k.dtype} differs from its program's {got['dtype']}"))
                continue
            if not (type(k.bucket_lo) is int and type(k.bucket_hi) is int and 1 <= k.bucket_lo <= k.bucket_hi):
                why = f"its bucket {k.bucket_lo!r}-{k.bucket_hi!r} is not 1 <= lo <= hi"  # a damaged row
                table.refused.append((k.id, why))
                table.skipped.append((k.id, why))
                continue
            found.setdefault(got["op"], {}).setdefault(key, []).append(
                Launcher(run, k.id, k.bucket_lo, k.bucket_hi, k.measured_us, k.modeled_us))
    for name, per in found.items():
        table.ops[name] = {key: disjoint(cands) for key, cands in per.items()}
    return table


class KernelRefused(Exception):
    """A kernel's load failed in the child process (the reason is its message)."""


def _prepare(k, spec) -> dict:
    """In the child: the kernel's op key and its rendered source, imported once; or why it is not
    a kernel for vLLM. Returns JSON data only. The proof is not re-run here (importing egglog alone
    takes seconds at every vLLM start): every write path re-proves through `registry.gate`, and a
    row whose own record says its proof failed is refused."""
    from prism_serve.optimize.codegen.render import load, render
    from prism_serve.registry.errors import RegistryError
    from prism_serve.registry.store import kernel_instance

    inst = kernel_instance(k, spec)
    if not (isinstance(k.sgraph.proof, dict) and k.sgraph.proof.get("ok") is True):
        raise RegistryError(f"kernel {k.id}: its sGraph's stored proof does not hold")
    prog = inst.sgraph.program
    op = KINDS.get(prog.name)
    key = op.key_of(prog) if op else None
    if key is None:
        return {"skip": f"program {prog.name!r} is not one prism can patch into vLLM"}
    source = render(inst)
    load(source)
    dtype, dim, eps = key
    return {"op": op.name, "dtype": dtype, "dim": dim, "eps": eps, "source": source}


def _import(got: dict) -> Callable:
    """In vLLM's process: the launcher of source that loaded cleanly in the child."""
    from prism_serve.optimize.codegen.render import load

    if got.get("op") not in KINDS or got.get("dtype") not in TORCH_DTYPES or not isinstance(got.get("source"), str):
        raise KernelRefused("its load answered an unknown op, dtype or source")
    if got["eps"] is not None and not isinstance(got["eps"], float):
        raise KernelRefused(f"its load answered epsilon {got['eps']!r}")
    return load(got["source"]).run


def _dim(dim) -> int | tuple[int, int]:
    """A key's dim as the table holds it: an int, or (hidden, projection size) for a region, or a
    rotary kind's sizes and style (the style's 0 is GPT-J's)."""
    ints = dim if isinstance(dim, list) and 2 <= len(dim) <= 6 else [dim]
    least = [1] * 5 + [0]  # a rotary key's sixth dim is its style: 0 for GPT-J
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= low for d, low in zip(ints, least)):
        raise KernelRefused(f"its load answered dim {dim!r}")
    return tuple(ints) if isinstance(dim, list) else dim


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
