"""The generator's worker processes (#11 item 5): what the search finds does not depend on the
number of workers, whether it walks every subtree or the work budget cuts it; the wall-clock
budget still holds; and a worker that fails or dies raises a clear error in the driver instead
of hanging it."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.bound import DesignBound
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import Design, LibrarySpec
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.pipeline.search import GRACE_S, MAX_GRID, optimize
from prism_serve.optimize.pipeline.workers import Config, Pool, default_workers
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.workloads.programs import WORKLOADS
from .generation import generate

H100 = get_gpu("h100")


def _silu_and_mul():
    return WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")


@pytest.mark.parametrize("cost_rule", [False, True], ids=["listing", "ranking"])
def test_the_workers_generate_the_serial_designs_in_the_serial_order(cost_rule):
    """Every subtree (depth, first-kernel group) in a worker, merged in round and group order:
    the same designs in the same order as one process, over two depths and library and block
    kernels, and the same counts; with the cost rule too (its threshold is the same in both:
    the designs of fewer kernels)."""
    prog = _silu_and_mul()
    bound = DesignBound(H100, (4, 64)) if cost_rule else None
    serial, parallel = (generate(prog, H100, (4, 64), max_kernels=2, max_block_ops=3, bound=bound, workers=w)
                        for w in (1, 2))
    assert parallel.designs == serial.designs
    assert not serial.stats.stopped_by_budget and not parallel.stats.stopped_by_budget
    assert serial.stats.open_subtrees == parallel.stats.open_subtrees == 0
    assert parallel.stats.pruned["abstract_expression"] > 0
    assert parallel.stats.pruned == serial.stats.pruned and parallel.stats.steps == serial.stats.steps
    if cost_rule:  # two kernels never beat silu_and_mul's one-kernel designs: depth 2 is cut whole
        assert {len(d.kernels) for d in serial.designs} == {1} and serial.stats.pruned["cost"] > 0
    else:
        assert len({d.kernels[0].__class__ for d in serial.designs}) == 2
        assert {len(d.kernels) for d in serial.designs} == {1, 2}


def test_a_search_cut_by_its_work_budget_finds_the_same_with_one_and_two_workers():
    """The work budget (steps) cuts the search short, yet one and two workers generate, cost and
    verify the same designs with the same counts: the budget is not time (#11 item 5)."""
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32)
    runs = {w: optimize(prog, "h100", (1, 8), work=150_000, budget_s=600, top=2, workers=w) for w in (1, 2)}
    one, two = runs[1].stats.to_json(), runs[2].stats.to_json()
    assert one["open_subtrees"] > 0 and not one["stopped_by_budget"] and not two["stopped_by_budget"]
    for volatile in ("workers", "search_s", "verify_s"):
        del one[volatile], two[volatile]
    assert one == two
    assert [f.design for f in runs[1].found] == [f.design for f in runs[2].found] and runs[1].found
    assert [[c.assignment for c in f.kernels] for f in runs[1].found] == \
        [[c.assignment for c in f.kernels] for f in runs[2].found]
    more = optimize(prog, "h100", (1, 8), work=600_000, budget_s=600, top=0, workers=1).stats
    assert more.block_graphs > runs[1].stats.block_graphs  # the budget did cut it


def test_one_and_two_workers_verify_the_same_designs_and_the_same_best():
    prog = _silu_and_mul()
    runs = {w: optimize(prog, "h100", (4,), max_kernels=1, max_block_ops=3, budget_s=600, all_designs=True, workers=w)
            for w in (1, 2)}
    hashes = {w: sorted(canonical_hash(f.sgraph) for f in r.found) for w, r in runs.items()}
    assert hashes[1] and hashes[1] == hashes[2]
    assert canonical_hash(runs[1].best.sgraph) == canonical_hash(runs[2].best.sgraph)
    assert runs[1].best.design == runs[2].best.design
    assert [f.numeric_error for f in runs[1].found] == [f.numeric_error for f in runs[2].found]
    assert (runs[1].stats.workers, runs[2].stats.workers) == (1, 2)
    assert runs[1].stats.to_json()["workers"] == 1 and runs[2].stats.verified == runs[1].stats.verified


def test_the_budget_holds_with_workers():
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32)
    start = time.perf_counter()
    result = optimize(prog, "h100", (8,), budget_s=4.0, work=10**9, workers=2)
    assert result.stats.stopped_by_budget
    assert time.perf_counter() - start < 4.0 + GRACE_S + 5  # pool start and stop included


def test_a_failing_or_dead_worker_raises_instead_of_hanging_the_driver():
    prog = WORKLOADS["rmsnorm_linear"].program()
    ctx = make_context(prog)
    first = KernelGenerator(ctx, max_kernels=2, max_block_ops=8, max_grid=MAX_GRID).choices()[0]
    with Pool(2, Config(prog, H100, (4,), 2, 8, MAX_GRID, True, None)) as pool:
        tid = pool.submit("verify", Design((LibrarySpec("y", "exp", ("no_such_tensor",)),)))
        with pytest.raises(SGraphError, match="worker \\d failed on verify task 0: SGraphError: .*'no_such_tensor'$"):
            pool.get(tid, time.time() + 120)
        tid = pool.submit("generate", 2, first, math.inf, math.inf, time.time() + 600)  # minutes of block walks
        assert pool.get(tid, time.time()) == (False, None)  # not answered yet: the driver does not wait
        for p in pool.procs:
            os.kill(p.pid, signal.SIGKILL)
        start = time.perf_counter()
        with pytest.raises(SGraphError, match=r"generator worker \d \(pid \d+\) died with exit code -9"):
            pool.get(tid, time.time() + 600)
        assert time.perf_counter() - start < 10


def test_workers_default_to_the_cores_and_must_be_positive():
    assert default_workers() == len(os.sched_getaffinity(0))
    with pytest.raises(SGraphError, match="workers must be a positive int"):
        optimize(_silu_and_mul(), "h100", (4,), workers=0)
    with pytest.raises(SGraphError, match="at least 2 workers"):
        Pool(1, Config(_silu_and_mul(), H100, (4,), 1, 2, MAX_GRID, True, None))
