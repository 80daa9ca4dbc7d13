"""Real parallel processes writing one registry (a SQLite file, or one PostgreSQL database):
nothing lost, nothing duplicated, nothing corrupt."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

from prism_serve.registry import open_registry
from prism_serve.registry.store import add_kernel, counts, list_kernels
from tests.registry.factory import DEVICES, result

WRITERS = 4
SHARED = 15  # keys every writer writes
OWN = 15  # keys only one writer writes


def _writer(path: str, index: int, start, errors) -> None:
    try:
        start.wait()
        reg = open_registry(path)  # the first writers race to create the schema too
        for i in range(max(SHARED, OWN)):
            if i < SHARED:  # overlapping keys, each in its own transaction
                with reg.write() as s:
                    add_kernel(s, result(bucket=(i + 1, i + 1), measured_us=float(index + 1)))
            if i < OWN:  # distinct keys: one bucket range per writer
                with reg.write() as s:
                    lo = 1000 * (index + 1) + i
                    add_kernel(s, result(bucket=(lo, lo), device=DEVICES[index % len(DEVICES)]))
        reg.close()
    except BaseException as exc:  # report to the parent instead of dying silently
        errors.put(f"writer {index}: {type(exc).__name__}: {exc}")
        raise


def test_parallel_writers_lose_nothing(registry_url):
    path = registry_url
    ctx = mp.get_context("fork")
    start, errors = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, i, start, errors)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert not problems, problems
    assert [p.exitcode for p in procs] == [0] * WRITERS

    reg = open_registry(path)
    with reg.read() as s:
        got = counts(s)
        kernels = list_kernels(s)
    reg.close()
    assert got["kernels"] == SHARED + WRITERS * OWN
    assert got["programs"] == 1 and got["sgraphs"] == 1 and got["program_sources"] == 1
    assert got["devices"] == len({DEVICES[i % len(DEVICES)] for i in range(WRITERS)} | {DEVICES[1]})
    shared = [k for k in kernels if k.bucket_lo <= SHARED]
    assert sorted(k.bucket_lo for k in shared) == list(range(1, SHARED + 1))
    assert {k.measured_us for k in shared} <= {float(i + 1) for i in range(WRITERS)}  # some writer's whole row
    if not path.startswith("sqlite"):
        return
    con = sqlite3.connect(path.removeprefix("sqlite:///"))
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    con.close()
