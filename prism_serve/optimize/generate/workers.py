"""Worker processes for the generator's driver (#11, item 5): independent subtrees of the search
(the designs of one depth under one first-kernel choice, `KernelGenerator.subtree`) and the
verification of single designs run in parallel.

Workers are started with the ``spawn`` context, never ``fork``: egglog's Rust runtime and torch's
thread pools are not fork-safe, and forked workers hung. Each worker builds its own Context (its
own egglog oracle, its own block-enumeration cache) from the Program, takes tasks from one queue
and answers on another. The driver reads the answers by task index, so what it merges does not
depend on the number of workers or on which worker ran what. A worker that dies (crash, OOM kill)
raises SGraphError in the driver; `Pool.get` waits for an answer only until a given time, and
`close` terminates the workers, so a hung worker never hangs the driver.

Deadlines cross process boundaries as wall-clock times (`time.time()`), converted to each
worker's `perf_counter`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.bound import DesignBound
from prism_serve.optimize.gpus import GpuSpec
from prism_serve.optimize.ir import Program

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a waiting driver checks that its workers are alive


def default_workers() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Config:
    """What every worker needs to rebuild the driver's generator for itself."""

    prog: Program
    gpu: GpuSpec
    buckets: tuple[int, ...]  # the num_tokens buckets designs are costed at
    max_kernels: int
    max_block_ops: int
    max_grid: int
    abstract_rule: bool
    bound: DesignBound | None  # None: the cost rule is off


@dataclass(frozen=True)
class Subtree:
    """One generation task's answer: the designs in `run` order, each costed (`search.Appraisal`:
    costing, not the walk, is most of a search's time), and what the walk counted."""

    appraised: tuple
    generated: int
    pruned: dict[str, int]
    kernel_graphs: int
    block_graphs: int
    stopped: bool  # the walk hit the deadline or cut a block enumeration short


class _Worker:
    def __init__(self, config: Config):
        self.config = config
        self.gen = None
        self.choices = None
        self.appraised: dict[str, Any] = {}  # canonical key -> Appraisal: a design seen again costs nothing

    def generate(self, depth: int, first, pending: int, deadline_wall: float, best_us: float) -> Subtree:
        from prism_serve.optimize.generate.context import make_context
        from prism_serve.optimize.generate.kernel import KernelGenerator

        c = self.config
        if self.gen is None:
            ctx = make_context(c.prog)
            ctx.oracle.enabled = c.abstract_rule
            self.gen = KernelGenerator(ctx, max_kernels=c.max_kernels, max_block_ops=c.max_block_ops,
                                       max_grid=c.max_grid, deadline=0.0, bound=c.bound)
            self.choices = self.gen.choices()  # the driver counts the choice-level rules once
        gen = self.gen
        before = gen.counts  # counts sum over the cached block walks, so a task reports its delta
        gen.kernel_graphs, gen.block_graphs, gen.stopped = 0, 0, False
        gen.deadline = time.perf_counter() + (deadline_wall - time.time())
        gen.pending = pending
        gen.best_us = best_us  # the driver's best design of fewer kernels (the cost rule)
        appraised = tuple(self._appraise(d) for d in gen.subtree(depth, first, self.choices))
        after = gen.counts
        pruned = {rule: n - before.pruned.get(rule, 0) for rule, n in after.pruned.items()}
        return Subtree(appraised, after.generated - before.generated, pruned, gen.kernel_graphs, gen.block_graphs,
                       gen.stopped or gen.truncated > 0)

    def _appraise(self, d) -> Any:
        from prism_serve.optimize.generate.search import Appraisal, appraise, built

        c = self.config
        b = built(c.prog, d)
        if b is None:
            return Appraisal(d, None)
        if b[1] not in self.appraised:
            self.appraised[b[1]] = appraise(c.prog, c.gpu, c.buckets, d, *b)
        return replace(self.appraised[b[1]], design=d)

    def verify(self, design) -> Any:
        from prism_serve.optimize.generate.search import verify_design

        return verify_design(self.config.prog, design, self.config.gpu)


def _serve(index: int, config: Config, tasks, answers) -> None:
    import torch

    torch.set_num_threads(1)  # one core per worker
    worker = _Worker(config)
    while True:
        tid, kind, args = tasks.get()
        try:
            answers.put((index, tid, True, getattr(worker, kind)(*args)))
        except Exception as exc:  # noqa: BLE001 - the driver raises it, the traceback logged
            answers.put((index, tid, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8))))


class Pool:
    """`n` spawned workers sharing one task queue; answers are read by task index."""

    def __init__(self, n: int, config: Config):
        if n < 2:
            raise SGraphError(f"a worker pool needs at least 2 workers, got {n}")
        ctx = multiprocessing.get_context("spawn")
        self.tasks, self.answers = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(i, config, self.tasks, self.answers), daemon=True,
                                  name=f"prism-generate-{i}") for i in range(n)]
        for p in self.procs:
            p.start()
        self.what: dict[int, str] = {}
        self.done: dict[int, Any] = {}

    def submit(self, kind: str, *args) -> int:
        tid = len(self.what)
        self.what[tid] = f"{kind} task {tid}"
        self.tasks.put((tid, kind, args))
        return tid

    def get(self, tid: int, until_wall: float) -> tuple[bool, Any]:
        """(True, answer) for task `tid`, or (False, None) if it is not answered by `until_wall`
        (a wall-clock time). Raises SGraphError when a worker failed or died."""
        while tid not in self.done:
            left = until_wall - time.time()
            if left <= 0:
                return False, None
            try:
                index, got, ok, answer = self.answers.get(timeout=min(left, POLL_S))
            except queue.Empty:
                dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    i, p = dead[0]
                    raise SGraphError(f"generator worker {i} (pid {p.pid}) died with exit code {p.exitcode} "
                                      f"while the driver waited for {self.what[tid]}") from None
                continue
            if not ok:
                reason, trace = answer
                log.debug("generator worker %d failed on %s:\n%s", index, self.what[got], trace)
                raise SGraphError(f"generator worker {index} failed on {self.what[got]}: {reason}")
            self.done[got] = answer
        return True, self.done.pop(tid)

    def close(self) -> None:
        """Stop every worker now (a task still running is abandoned)."""
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        for q in (self.tasks, self.answers):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
