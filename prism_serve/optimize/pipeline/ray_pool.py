"""The search's workers as Ray actors (#39): `RayPool` speaks `Pool`'s interface (submit, idle,
receive, get, done, close), so the driver (`search.py`) runs the same rounds with the same shares
whatever the number of nodes, and merges the same answers in the same order.

Each actor holds one `Worker` (its own Context, its subtrees' paused walks), as a `Pool` process
does. Ray restarts an actor whose process dies and retries the tasks it had (`MAX_RESTARTS`,
`MAX_TASK_RETRIES`); a restarted actor holds no walks, so every generation task carries the
allowances its subtree was granted before (`earlier`) and an actor that lacks the walk replays
them first. A task's answer is thus a function of its arguments alone, retried or not, and a
killed worker changes nothing in the result. Nothing reaches a registry before the search ends.
Each answer is logged as it comes (INFO, with `task`, `seconds` spent in the actor and, for a
generation task, `step` = (depth, round) as extra fields: `scripts/bench_fleet.py` reads them).

Ray is an optional extra (`prism-serve[ray]`): `ray_module` imports it or says in one line how to
install it. `connect` joins a cluster (`auto` or an address) or, given `local`, starts one on this
machine (loopback only), and says whether it did, so that only what was started is shut down."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from prism_serve.errors import PrismError, SGraphError
from prism_serve.optimize.pipeline.workers import POLL_S, Config, Worker, default_workers

log = logging.getLogger(__name__)
LOCAL = "local"  # `--ray` without an address: a cluster of this machine's cores, started here
MAX_RESTARTS = 4  # times Ray restarts a dead worker actor
MAX_TASK_RETRIES = 4  # times Ray reruns a task whose actor died under it
INSTALL = "Ray is not installed: pip install 'prism-serve[ray]' (ray==2.60.0)"


class RayError(PrismError):
    """Ray is missing, or the cluster cannot be reached or lost what it ran."""


def ray_module():
    """`ray`, or RayError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RayError(INSTALL) from None
    return ray


def connect(address: str = LOCAL, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address` ("auto": the one `ray start` runs here), or with `local` start
    one of `num_cpus` (default: this machine's cores) on loopback; a driver already connected
    stays so. Returns whether this call started the connection (whoever did shuts it down)."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    try:
        if address == LOCAL:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray 2.60: node IP 127.0.0.1
            ray.init(num_cpus=num_cpus or default_workers(), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayError(f"cannot reach the Ray cluster at {address}: {exc}") from None
    return True


@contextmanager
def ray_session(address: str | None, num_cpus: int | None = None) -> Iterator[None]:
    """Connected to `address` (None: nothing to do) for the block, so that the searches inside
    it share one cluster; shut down after if this started it."""
    started = connect(address, num_cpus) if address is not None else False
    try:
        yield
    finally:
        if started:
            ray_module().shutdown()


class _RayWorker:
    """The actor: one `Worker`, one core."""

    def __init__(self, config: Config):
        import torch

        torch.set_num_threads(1)
        self.worker = Worker(config)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, depth, first, allowance, best_us, deadline_wall, earlier) -> tuple[float, Any]:
        start = time.perf_counter()
        answer = self.worker.generate(depth, first, allowance, best_us, deadline_wall, earlier)
        return time.perf_counter() - start, answer

    def verify(self, design) -> tuple[float, Any]:
        start = time.perf_counter()
        answer = self.worker.verify(design)
        return time.perf_counter() - start, answer


class RayPool:
    """`workers` actors (default: the cluster's CPUs), each one core, answers read by task index."""

    def __init__(self, config: Config, address: str = LOCAL, workers: int | None = None):
        ray = self.ray = ray_module()
        self.started = connect(address, workers)
        try:
            n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
            actor = ray.remote(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES)(_RayWorker)
            self.size = n
            # the config by value, not an object-store reference: a restarted actor rebuilds from it
            self.actors = [actor.remote(config) for _ in range(n)]
        except BaseException:
            self._disconnect()
            raise
        self.what: dict[int, str] = {}
        self.where: dict[int, int] = {}
        self.step: dict[int, tuple] = {}  # generation task -> (depth, round): what ran side by side
        self.refs: dict[Any, int] = {}  # pending ObjectRef -> its task
        self.running = [0] * n
        self.granted: dict[tuple, tuple] = {}  # (depth, first group) -> the (allowance, best_us) granted so far
        self.done: dict[int, Any] = {}

    def submit(self, kind: str, *args, worker: int | None = None) -> int:
        """Send a task to actor `worker`, or (None) to the one with the fewest tasks running."""
        if worker is None:
            worker = min(range(self.size), key=lambda w: self.running[w])
        if kind == "generate":
            depth, first, allowance, best_us, _ = args
            key = (depth, first)
            earlier = self.granted.get(key, ())
            self.granted[key] = (*earlier, (allowance, best_us))
            args = (*args, earlier)
            self.step[len(self.what)] = (depth, len(earlier))
        tid = len(self.what)
        self.what[tid] = f"{kind} task {tid}"
        self.where[tid] = worker
        self.running[worker] += 1
        self.refs[getattr(self.actors[worker], kind).remote(*args)] = tid
        return tid

    def idle(self, worker: int) -> bool:
        return self.running[worker] == 0

    def receive(self, until_wall: float) -> bool:
        """Wait for the next answer of any task until `until_wall`; whether one came. Raises
        SGraphError when a task failed or its worker died past Ray's restarts."""
        ray = self.ray
        while self.refs:
            left = until_wall - time.time()
            if left <= 0:
                return False
            ready, _ = ray.wait(list(self.refs), num_returns=1, timeout=min(left, POLL_S))
            if not ready:
                continue
            tid = self.refs.pop(ready[0])
            self.running[self.where[tid]] -= 1
            try:
                seconds, self.done[tid] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise SGraphError(f"Ray worker {self.where[tid]} died past {MAX_RESTARTS} restarts while running "
                                  f"{self.what[tid]}: {str(exc).splitlines()[0]}") from None
            except ray.exceptions.RayTaskError as exc:
                log.debug("Ray worker %d failed on %s:\n%s", self.where[tid], self.what[tid], exc)
                raise SGraphError(f"Ray worker {self.where[tid]} failed on {self.what[tid]}: "
                                  f"{type(exc.cause).__name__}: {exc.cause}") from None
            kind = self.what[tid].split()[0]
            log.info("%s done on Ray worker %d in %.2f s", self.what[tid], self.where[tid], seconds,
                     extra={"task": kind, "seconds": seconds, "step": self.step.get(tid)})
            return True
        return False

    def get(self, tid: int, until_wall: float) -> tuple[bool, Any]:
        """(True, answer) for task `tid`, or (False, None) if it is not answered by `until_wall`."""
        while tid not in self.done:
            if not self.receive(until_wall):
                return False, None
        return True, self.done.pop(tid)

    def close(self) -> None:
        """Stop every actor now (a task still running is abandoned, not retried)."""
        for ref in self.refs:
            self.ray.cancel(ref)
        self.refs = {}
        for a in self.actors:
            self.ray.kill(a, no_restart=True)
        self.actors = []
        self._disconnect()

    def _disconnect(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
