"""The plugin's state in one process, owned by one object: the dispatch table, the counters, the
kernels that failed, the plain weights of what vLLM packed, vLLM's own path per kind, the patched
model sites, and the fusion pass's matchers.

`hooks.install` builds a `Runtime` for the table it installs (through `ops.open_runtime`, which
registers the `prism::` kernels closing over it) and hands it to every hook; `Installed.revert`
closes it. Tests build their own the same way, instead of resetting module globals.

torch's operator registry is process-global, so one runtime at a time owns the `prism::` kernels:
`current()` names it. Only the fusion pass reads it, because vLLM pickles the pass into its config
for worker processes, where it finds that process's runtime (built by the plugin there).

Calls are counted per kind (`counts`: kernel launches, `misses`: vLLM's path ran) and written as
JSON to $PRISM_SERVE_COUNTERS (at exit, and every half second while serving), so tests can prove
the kernels ran.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prism_serve.patch.table import Table
from prism_serve.region_table import KINDS

log = logging.getLogger("vllm.prism_serve.ops")  # among vLLM's own lines, like the plugin's (see plugin.py)
COUNTERS_ENV = "PRISM_SERVE_COUNTERS"


def is_handle(weight: Tensor) -> bool:
    """vLLM's oneDNN handler tensor: a 0-d int64 tensor holding the packed GEMM's pointer."""
    return weight.dim() == 0 and weight.dtype == torch.int64


def out_features(weight: Tensor, given: int) -> int:
    """A projection's output size: its weight's rows, or `given` for vLLM's handle (which has no shape)."""
    return given if is_handle(weight) else weight.shape[0]


@dataclass(frozen=True)
class PackedExperts:
    """One MoE layer's stacked weights as vLLM's checkpoint holds them (w13 [E, 2I, H], w2 [E, H, I],
    recorded before its CPU experts padded and packed them), and the instruction set it packed them for."""

    w13: Tensor
    w2: Tensor
    isa: str


class Runtime:
    """What the serving path reads and writes in this process (see the module docstring)."""

    _current: ClassVar[Runtime | None] = None

    def __init__(self, table: Table | None = None) -> None:
        self.table = table
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.misses: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.failed: set[int] = set()  # kernel ids that raised at run time: never launched again
        # vLLM's own path per kind: the torch references (`ops.references`), replaced by the vLLM hooks'
        self.fallbacks: dict[str, Callable] = {}
        # oneDNN handle (the pointer value vLLM keeps in its handler tensor) -> the plain [out, in] weight
        # it was packed from, recorded while vLLM loads the weights (`packed.install`)
        self.packed: dict[int, Tensor] = {}
        # data pointer of every weight vLLM packed for its AMX GEMM (`_C.weight_packed_linear`) -> the plain
        # [out, in] weight, or None where no region kernel serves its shape. A packed weight has the plain
        # one's dtype and shape, so only this tells the two apart.
        self.packed_amx: dict[int, Tensor | None] = {}
        # data pointer of the w13 weight vLLM's CPU experts packed -> the plain stacked weights and what
        # vLLM's kernel needs to run on the packed ones, for the MoE layers a kernel serves (`experts_hook`)
        self.experts: dict[int, PackedExperts] = {}
        self.sites: list[weakref.ref] = []  # the MLPs eager mode patched, by their `site`
        self.layer_sites: list[weakref.ref] = []  # the decoder layers eager mode patched, by their `site`
        self.matchers: tuple | None = None  # the fusion pass's pattern matcher passes, built once
        self.runs: Counter = Counter()  # graphs the fusion pass ran on
        self.replaced: Counter = Counter()  # regions it replaced, by kind
        self.library: torch.library.Library | None = None  # the prism:: kernels, closing over this runtime
        self.model: str | None = None  # the model vLLM serves (its config's), for the lines that name it
        self.explained: set[str] = set()  # kinds whose miss said why no kernel could serve it
        self._flushing: int | None = None  # the pid whose thread writes the counters
        self._closed = threading.Event()  # ends that thread

    # --- ownership of the prism:: kernels ---------------------------------------------------

    def own(self, library: torch.library.Library) -> None:
        """Hold `library` (the kernels registered for this runtime) and become the current runtime."""
        if Runtime._current is not None and Runtime._current is not self:
            Runtime._current.close()
        self.library, Runtime._current = library, self

    def close(self) -> None:
        """Drop this runtime's kernels (the ops' schemas stay defined, see `ops.define`)."""
        self._closed.set()
        if self.library is not None:
            self.library._destroy()
            self.library = None
        if Runtime._current is self:
            Runtime._current = None

    # --- dispatch ---------------------------------------------------------------------------

    def pick(self, kind: str, x: Tensor, dim, eps: float | None):
        """The launcher for this call, counted, or None: prism's whole per-call dispatch cost
        (table and bucket lookup, bookkeeping) before the kernel launch."""
        table = self.table
        if table is None or x.device.type != table.device:
            return None
        buckets = table.entry(kind, x.dtype, dim, eps)
        if buckets is None:
            return None
        launcher = buckets.pick(x.numel() // x.shape[-1])  # rows: tokens (x heads for q/k norm)
        if launcher is None or launcher.kernel_id in self.failed:
            return None
        self.counts[kind] += 1
        return launcher

    def failed_kernel(self, kind: str, launcher, exc: BaseException) -> None:
        """A kernel raised at run time: vLLM's own path serves its calls from now on."""
        self.counts[kind] -= 1
        self.failed.add(launcher.kernel_id)
        log.warning("prism-serve: kernel %d for %s failed (%s: %s); vLLM's own path serves it from now on",
                    launcher.kernel_id, kind, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")

    # --- a projection's weight: the plain tensor, or what vLLM's CPU build packed it into -------

    def _is_amx_packed(self, weight: Tensor) -> bool:
        return weight.device.type == "cpu" and weight.data_ptr() in self.packed_amx

    def plain_weight(self, weight: Tensor) -> Tensor | None:
        """The [out, in] weight a kernel multiplies with, or None where none was recorded."""
        if is_handle(weight):
            return self.packed.get(int(weight.item()))
        return self.packed_amx[weight.data_ptr()] if self._is_amx_packed(weight) else weight

    def vllm_linear(self, x: Tensor, weight: Tensor, n: int, bias: Tensor | None = None) -> Tensor:
        """vLLM's projection: its oneDNN GEMM on the handle, its AMX GEMM on a weight it packed for
        that, or torch's linear."""
        if not is_handle(weight) and not self._is_amx_packed(weight):
            return torch.nn.functional.linear(x, weight, bias)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        if is_handle(weight):
            torch.ops._C.onednn_mm(out, x.reshape(-1, x.shape[-1]), bias, weight)
        else:
            torch.ops._C.weight_packed_linear(out.reshape(-1, n), x.reshape(-1, x.shape[-1]), weight, bias, True)
        return out

    # --- counters -----------------------------------------------------------------------------

    def counters(self) -> dict:
        return {"kernel": dict(self.counts), "fallback": dict(self.misses), "failed_kernels": sorted(self.failed)}

    def write_counters(self) -> None:
        path = os.environ.get(COUNTERS_ENV)
        if not path or not (any(self.counts.values()) or any(self.misses.values())):
            return  # a process that ran no prism op (e.g. vLLM's API server) leaves the file alone
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.counters() | {"pid": os.getpid()}, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("prism-serve: cannot write counters to %s: %s", path, exc)

    def write_counters_at_exit(self, period_s: float = 0.5) -> None:
        """Write the counters to $PRISM_SERVE_COUNTERS at exit and, while serving, every `period_s`
        (vLLM's workers may end without running atexit)."""
        if self._flushing == os.getpid() or not os.environ.get(COUNTERS_ENV):
            return  # a forked child inherits the runtime but not the thread: it starts its own
        if self._flushing is None:
            atexit.register(self.write_counters)
        threading.Thread(target=self._flush_periodically, args=(period_s,), name="prism-counters",
                         daemon=True).start()
        self._flushing = os.getpid()

    def _flush_periodically(self, period_s: float) -> None:
        last = None
        while not self._closed.wait(period_s):
            now = (tuple(self.counts.values()), tuple(self.misses.values()))
            if now != last:
                self.write_counters()
                last = now


def current() -> Runtime | None:
    """The runtime whose kernels the `prism::` ops run in this process, if any."""
    return Runtime._current
