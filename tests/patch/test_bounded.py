"""`bounded.run_each`: whatever an item does in the forked child (raise SystemExit, hang while
holding the GIL, end the process, allocate without end), the caller gets every other item's
value and one reason for the bad one, within the time bound."""

from __future__ import annotations

import os
import time

from prism_serve.patch.bounded import CHILD_MEMORY_BYTES, run_each


def _misbehave(item):
    kind, n = item
    if kind == "exit":
        exit(n)  # the builtin a payload would call: SystemExit
    if kind == "os._exit":
        os._exit(n)
    if kind == "hang":
        return 9 ** 9 ** n  # 9**9**9: one C-level power of minutes, holding the GIL; no signal gets in
    if kind == "memory":
        return len(bytearray(2 * CHILD_MEMORY_BYTES))
    if kind == "not json":
        return {1, 2}
    return {"square": n * n}


def test_each_bad_item_gets_its_reason_and_the_others_their_values():
    items = [("ok", 2), ("exit", 3), ("ok", 3), ("os._exit", 4), ("ok", 4), ("hang", 9), ("ok", 5),
             ("memory", 0), ("not json", 0), ("ok", 6)]
    start = time.monotonic()
    got = run_each(_misbehave, items, timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert [g.value for g, (kind, _) in zip(got, items) if kind == "ok"] == [{"square": n * n} for n in (2, 3, 4, 5, 6)]
    errors = {kind: g.error for g, (kind, _) in zip(got, items) if kind != "ok"}
    assert errors["exit"] == "SystemExit: 3"
    assert errors["os._exit"] == "ended the loading process (exit status 4)"
    assert errors["hang"] == "took longer than 2 s to load"
    assert errors["memory"].startswith("MemoryError")
    assert errors["not json"].startswith("not JSON data")
    assert 2.0 <= elapsed < 2.0 + 10  # one timeout, not one per item


def test_nothing_to_run_forks_nothing():
    assert run_each(_misbehave, [], timeout_s=1.0) == []


def test_a_process_that_ignores_sigchld_still_gets_every_outcome():
    import signal
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    try:
        got = run_each(_misbehave, [("ok", 2), ("os._exit", 4), ("ok", 3)], timeout_s=5.0)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert got[0].value == {"square": 4} and got[2].value == {"square": 9}
    assert got[1].error.startswith("ended the loading process")


def _slow(item):
    time.sleep(item)
    return item


def test_slow_items_cannot_add_up_past_the_budget():
    start = time.monotonic()
    got = run_each(_slow, [0.9] * 10, timeout_s=2.0, budget_s=3.0)
    assert time.monotonic() - start < 3.0 + 2.0
    done = [g for g in got if g.error is None]
    assert 2 <= len(done) <= 4 and all(g.value == 0.9 for g in done)
    assert got[: len(done)] == done  # in order, then the rest refused without running
    assert all(g.error == "not loaded: the 3 s for loading all kernels were spent" for g in got[len(done):])
