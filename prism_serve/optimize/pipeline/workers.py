"""Workers for the generator's driver (#11, item 5): independent subtrees of the search (the
designs of one depth under one first-kernel group, `KernelGenerator.explore`) and the
verification of single designs.

`Pool` runs them in worker processes, `InlinePool` in this one; the driver speaks to both alike.
A subtree is walked for the steps the driver grants it, and a later task may grant more: that
task goes to the worker that holds the subtree's paused walk (`submit(..., worker=)`). What a
task answers depends only on its arguments, so what the driver merges, in task order, does not
depend on the number of workers or on which worker ran what.

Worker processes are started with the ``spawn`` context, never ``fork``: egglog's Rust runtime
and torch's thread pools are not fork-safe, and forked workers hung. Each builds its own Context
(its own egglog oracle) from the Program, takes tasks from its own queue and answers on a shared
one. A worker that dies (crash, OOM kill) raises SGraphError in the driver; `Pool.get` waits for
an answer only until a given time, and `close` terminates the workers, so a hung worker never
hangs the driver.

Deadlines (a safety net: the budget is counted in steps) cross process boundaries as wall-clock
times (`time.time()`), converted to each worker's `perf_counter`.
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
from prism_serve.optimize.ir.program import Program
from prism_serve.optimize.pipeline import stages
from prism_serve.optimize.target.gpus import GpuSpec

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
    """One generation task's answer: the designs in the walk's order, each costed
    (`stages.Appraisal`: costing, not the walk, is most of a search's time), and what the walk
    counted and spent."""

    appraised: tuple
    generated: int
    pruned: dict[str, int]
    iterators: tuple[int, int]  # input iterator maps judged, and kept (`block.Counts`)
    kernel_graphs: int
    block_graphs: int
    steps: int  # spent by this task
    open: bool  # more steps would walk further (`KernelGenerator.open`)
    stopped: bool  # the wall-clock deadline stopped the walk


class Worker:
    def __init__(self, config: Config, ctx=None):
        self.config = config
        self.ctx = ctx  # the Program's Context (its egglog oracle), built on the first task if not given
        self.choices = None
        self.subtrees: dict = {}  # (depth, first group) -> its KernelGenerator, while it may be resumed
        self.appraised: dict[str, Any] = {}  # canonical key -> Appraisal: a design seen again costs nothing

    def generate(self, depth: int, first, allowance: float, best_us: float, deadline_wall: float,
                 earlier: tuple[tuple[float, float], ...] = ()) -> Subtree:
        """Walk the subtree (`depth`, `first`) for `allowance` more steps, resuming it if an
        earlier task walked it here; `best_us` is the cost rule's threshold for the depth.
        `earlier`: the (allowance, best_us) of the tasks that walked it before, replayed (their
        designs dropped) when this worker does not hold the walk (`ray_pool`: a restarted actor)."""
        from prism_serve.optimize.generate.context import make_context
        from prism_serve.optimize.generate.kernel import KernelGenerator

        c = self.config
        if self.choices is None:
            if self.ctx is None:
                self.ctx = make_context(c.prog)
                self.ctx.oracle.enabled = c.abstract_rule
            # the driver counts the choice-level rules once
            self.choices = KernelGenerator(self.ctx, max_kernels=c.max_kernels, max_block_ops=c.max_block_ops,
                                           max_grid=c.max_grid).choices()
        for key in [k for k in self.subtrees if k[0] < depth]:  # the driver never returns to a depth
            del self.subtrees[key]
        key = (depth, first)
        gen = self.subtrees.get(key)
        if gen is None:
            gen = self.subtrees[key] = KernelGenerator(self.ctx, max_kernels=c.max_kernels,
                                                       max_block_ops=c.max_block_ops, max_grid=c.max_grid,
                                                       bound=c.bound)
            gen.deadline = time.perf_counter() + (deadline_wall - time.time())
            for steps, bar in earlier:
                gen.best_us = bar
                for _ in gen.explore(depth, first, self.choices, steps):
                    pass
        gen.deadline = time.perf_counter() + (deadline_wall - time.time())
        gen.best_us = best_us
        before, steps, kernels, blocks = gen.counts, gen.steps, gen.kernel_graphs, gen.block_graphs
        appraised = tuple(self._appraise(d) for d in gen.explore(depth, first, self.choices, allowance))
        after = gen.counts
        if not gen.open:
            del self.subtrees[key]
        return Subtree(appraised, after.generated - before.generated,
                       {rule: n - before.pruned.get(rule, 0) for rule, n in after.pruned.items()},
                       (after.iterators - before.iterators, after.iterators_kept - before.iterators_kept),
                       gen.kernel_graphs - kernels, gen.block_graphs - blocks, gen.steps - steps, gen.open,
                       gen.stopped)

    def _appraise(self, d) -> Any:
        c = self.config
        b = stages.built(c.prog, d)
        if b is None:
            return stages.Appraisal(d, None)
        if b[1] not in self.appraised:
            self.appraised[b[1]] = stages.appraise(c.prog, c.gpu, c.buckets, d, *b)
        return replace(self.appraised[b[1]], design=d)

    def verify(self, design) -> Any:
        return stages.verify_design(self.config.prog, design, self.config.gpu)


class InlinePool:
    """One worker in this process: a task runs when it is submitted (its errors raise there). It
    may share the driver's Context (`ctx`), which saves saturating the targets' e-graph twice."""

    def __init__(self, config: Config, ctx=None):
        self.size = 1
        self.worker = Worker(config, ctx)
        self.done: dict[int, Any] = {}
        self._next = 0

    def submit(self, kind: str, *args, worker: int | None = None) -> int:
        tid, self._next = self._next, self._next + 1
        self.done[tid] = getattr(self.worker, kind)(*args)
        return tid

    def idle(self, worker: int) -> bool:
        return True

    def receive(self, until_wall: float) -> bool:
        return False

    def get(self, tid: int, until_wall: float) -> tuple[bool, Any]:
        return True, self.done.pop(tid)

    def close(self) -> None:
        pass

    def __enter__(self) -> "InlinePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(index: int, config: Config, tasks, answers) -> None:
    import torch

    torch.set_num_threads(1)  # one core per worker
    worker = Worker(config)
    while True:
        tid, kind, args = tasks.get()
        try:
            answers.put((index, tid, True, getattr(worker, kind)(*args)))
        except Exception as exc:  # noqa: BLE001 - the driver raises it, the traceback logged
            answers.put((index, tid, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=8))))


class Pool:
    """`n` spawned workers, each with its own task queue; answers are read by task index."""

    def __init__(self, n: int, config: Config):
        if n < 2:
            raise SGraphError(f"a worker pool needs at least 2 workers, got {n}")
        ctx = multiprocessing.get_context("spawn")
        self.size = n
        self.tasks, self.answers = [ctx.Queue() for _ in range(n)], ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(i, config, self.tasks[i], self.answers), daemon=True,
                                  name=f"prism-generate-{i}") for i in range(n)]
        for p in self.procs:
            p.start()
        self.what: dict[int, str] = {}
        self.where: dict[int, int] = {}  # task -> the worker it was sent to
        self.running = [0] * n  # per worker, tasks sent and not answered
        self.done: dict[int, Any] = {}

    def submit(self, kind: str, *args, worker: int | None = None) -> int:
        """Send a task to `worker`, or (None) to the one with the fewest tasks running."""
        if worker is None:
            worker = min(range(self.size), key=lambda w: self.running[w])
        tid = len(self.what)
        self.what[tid] = f"{kind} task {tid}"
        self.where[tid] = worker
        self.running[worker] += 1
        self.tasks[worker].put((tid, kind, args))
        return tid

    def idle(self, worker: int) -> bool:
        return self.running[worker] == 0

    def receive(self, until_wall: float) -> bool:
        """Wait for the next answer of any task until `until_wall`; whether one came. Raises
        SGraphError when a worker failed or died."""
        while True:
            left = until_wall - time.time()
            if left <= 0:
                return False
            try:
                index, got, ok, answer = self.answers.get(timeout=min(left, POLL_S))
            except queue.Empty:
                dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    i, p = dead[0]
                    waited = [self.what[t] for t, w in self.where.items() if w == i and t not in self.done]
                    raise SGraphError(f"generator worker {i} (pid {p.pid}) died with exit code {p.exitcode} "
                                      f"while the driver waited for {', '.join(waited) or 'its answers'}") from None
                continue
            self.running[index] -= 1
            if not ok:
                reason, trace = answer
                log.debug("generator worker %d failed on %s:\n%s", index, self.what[got], trace)
                raise SGraphError(f"generator worker {index} failed on {self.what[got]}: {reason}")
            self.done[got] = answer
            return True

    def get(self, tid: int, until_wall: float) -> tuple[bool, Any]:
        """(True, answer) for task `tid`, or (False, None) if it is not answered by `until_wall`
        (a wall-clock time). Raises SGraphError when a worker failed or died."""
        while tid not in self.done:
            if not self.receive(until_wall):
                return False, None
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
        for q in (*self.tasks, self.answers):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
