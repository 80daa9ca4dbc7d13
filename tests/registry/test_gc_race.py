"""`gc` racing a writer that reuses an orphaned sGraph, program and device, in both orders, on
SQLite and on a real PostgreSQL server: the writer's committed kernel survives, and gc still
drops what no kernel uses."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from prism_serve.registry.store import add_kernel, counts, gc, list_kernels, remove_kernels
from tests.registry.factory import result

WAIT_S = 20  # how long either side may wait for the other before the test gives up


def _orphans(registry) -> None:
    """An rms_norm kernel and a swiglu kernel, both removed: their sGraphs, programs and device
    are orphans; the writer below reuses the rms_norm ones."""
    with registry.write() as s:
        ids = [add_kernel(s, result(bucket=(1, 16))), add_kernel(s, result(workload="swiglu", hidden=256))]
    with registry.write() as s:
        remove_kernels(s, ids)


def _blocked_on_a_lock(registry) -> bool:
    """Whether another session of this PostgreSQL database waits for a row or table lock."""
    if registry.is_sqlite:
        return False  # not observable: the caller waits its grace period instead
    with registry.engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")).scalar())


def _hold_until(registry, other_done: threading.Event, grace_s: float = 1.0) -> None:
    """Keep the caller's transaction open until the other side finished or is blocked on it."""
    start = time.monotonic()
    while not other_done.is_set() and not _blocked_on_a_lock(registry):
        if registry.is_sqlite and time.monotonic() - start > grace_s:
            return
        assert time.monotonic() - start < WAIT_S, "the other transaction neither finished nor waited"
        time.sleep(0.05)


def _run(first, second) -> dict:
    """`first(started, second_done)` in a thread; `second()` once `first` is inside its transaction."""
    started, second_done, out = threading.Event(), threading.Event(), {}

    def run_first():
        try:
            out["first"] = first(started, second_done)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["first_error"] = exc
            started.set()

    t = threading.Thread(target=run_first)
    t.start()
    assert started.wait(WAIT_S)
    try:
        out["second"] = second()
    finally:
        second_done.set()
        t.join(WAIT_S)
    assert "first_error" not in out, out["first_error"]
    return out


@pytest.mark.parametrize("order", ["writer first", "gc first"])
def test_gc_racing_a_writer_keeps_the_writers_kernel(registry, order):
    _orphans(registry)

    def write(started=None, gc_done=None):
        with registry.write() as s:
            kid = add_kernel(s, result(bucket=(17, 32)))  # the orphaned sGraph, program and device again
            if started is not None:
                started.set()
                _hold_until(registry, gc_done)
        return kid

    def collect(started=None, writer_done=None):
        with registry.write() as s:
            removed = gc(s)
            if started is not None:
                started.set()
                _hold_until(registry, writer_done)
        return removed

    out = _run(write, collect) if order == "writer first" else _run(collect, write)
    kid, removed = (out["first"], out["second"]) if order == "writer first" else (out["second"], out["first"])
    with registry.read() as s:
        kernels = list_kernels(s)
        left = counts(s)
    assert [k.id for k in kernels] == [kid] and (kernels[0].bucket_lo, kernels[0].bucket_hi) == (17, 32)
    assert kernels[0].program.name == "rms_norm" and kernels[0].sgraph.program_id == kernels[0].program_id
    assert left["sgraphs"] == left["programs"] == left["devices"] == 1
    assert removed["sgraphs"] >= 1 and removed["programs"] >= 1  # the swiglu orphans went, racing or not
