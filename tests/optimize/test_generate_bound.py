"""The cost rule (`generate/bound.py`): its bound never exceeds the cost model's time for any
design it could cut, so a ranking search finds the same best design as an exhaustive listing;
and the kernel-level walk stores what a one-kernel fused_add_rms_norm needs (a consumed value
that is a program output) and completes designs whose last kernel is a library op."""

from __future__ import annotations

import math
import time

import pytest

from prism_serve.optimize.generate.bound import DesignBound, touched
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import LibrarySpec, build
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.instantiate.tune import best_modeled
from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.pipeline.search import DEPTH_SHARE, MAX_GRID, SearchStats, _Costed, optimize
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.workloads.programs import WORKLOADS
from .generation import generate

BUCKETS = (1, 16)


def _listing(prog, gpu, max_kernels: int, max_block_ops: int) -> _Costed:
    return generate(prog, gpu, BUCKETS, max_kernels=max_kernels, max_block_ops=max_block_ops)


@pytest.mark.parametrize("gpu", ["h100", "l4"])
@pytest.mark.parametrize("name,dims,kernels,ops", [
    ("silu_and_mul", {"intermediate": 40}, 2, 3),  # library and block kernels, one and two of them
    ("swiglu", {"hidden": 48, "intermediate": 40}, 1, 6),  # loops, split (a second launch) or not
])
def test_the_bound_is_below_the_modeled_time_of_every_design(name, dims, kernels, ops, gpu):
    """Every design, modeled at its best instance per bucket by the cost model, costs at least
    the bound of any of its prefixes (what the rule compares)."""
    spec = get_gpu(gpu)
    prog = WORKLOADS[name].program(**dims, dtype="float16")
    costed = _listing(prog, spec, kernels, ops)
    assert {len(d.kernels) for _, d, _ in costed.items} == set(range(1, kernels + 1))
    bound = DesignBound(spec, BUCKETS)
    outputs = set(prog.outputs)
    for modeled, design, g in costed.items:
        types = dict(g.tensors)
        assert modeled == sum(best_modeled(g, spec, nt).modeled_us for nt in BUCKETS)
        for cut in range(len(design.kernels) + 1):
            head = design.kernels[:cut]
            written = set().union(*map(touched, head)) & outputs  # a kernel reads an output only once written
            lower = bound.lower_us(head, types, outputs - written, len(design.kernels) - cut)
            assert lower <= modeled + 1e-9, (design.describe(), cut, lower, modeled)


def test_ranking_with_the_cost_rule_finds_the_best_design_of_the_listing():
    prog = WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")
    listing = optimize(prog, "h100", BUCKETS, max_kernels=2, max_block_ops=3, budget_s=600, all_designs=True,
                       workers=1)
    ranking = optimize(prog, "h100", BUCKETS, max_kernels=2, max_block_ops=3, budget_s=600, top=1, workers=1)
    assert ranking.stats.pruned["cost"] > 0 and listing.stats.pruned["cost"] == 0
    assert canonical_hash(ranking.best.sgraph) == canonical_hash(listing.best.sgraph)
    assert len(listing.found) > len(ranking.found)


def test_one_kernel_writes_the_residual_sum_that_its_norm_consumes():
    """fused_add_rms_norm's r = x + residual feeds the norm and is an output: one kernel stores it
    and y (before, only unused values were stored, so r took a kernel of its own)."""
    prog = WORKLOADS["fused_add_rms_norm"].program(hidden=40, dtype="float32")
    costed = _listing(prog, get_gpu("h100"), 1, 7)
    one = [d for d in costed.designs if len(d.kernels) == 1]
    assert one, "no one-kernel design"
    for d in one:
        stores = [o.attr("tensor") for o in d.kernels[0].ops if o.op == "store"]
        assert sorted(stores) == ["r", "y"]
        build(prog, d)  # and it builds


def test_a_library_op_can_write_the_last_output():
    """A design whose last kernel is a library op writing the output: two library kernels for
    silu_and_mul (silu, then the product)."""
    prog = WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")
    costed = _listing(prog, get_gpu("h100"), 2, 1)
    libs = [d for d in costed.designs if all(isinstance(k, LibrarySpec) for k in d.kernels)]
    assert [[(k.op, k.out) for k in d.kernels] for d in libs] == [[("silu", "t0_0"), ("mul", "y")]]


def test_no_design_keeps_a_dead_kernel():
    """Every kernel of every design writes an output or something a later kernel reads (a kernel
    nothing uses was generated in front of rmsnorm_mlp's winner before this rule)."""
    from prism_serve.optimize.generate.design import reads, writes

    prog = WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")
    costed = _listing(prog, get_gpu("h100"), 2, 3)
    assert {len(d.kernels) for d in costed.designs} == {1, 2}
    for d in costed.designs:
        for i, k in enumerate(d.kernels):
            later = set().union(*(reads(j) for j in d.kernels[i + 1:]))
            assert writes(k) & (set(prog.outputs) | later), d.describe()
    assert costed.stats.pruned["canonical"] > 0


def test_a_subtree_granted_its_steps_in_parts_finds_what_one_grant_finds():
    """`explore` resumes where the last grant of steps ran out: granted a few steps at a time
    until it is no longer open, a subtree yields every design of one unlimited walk, once each;
    a walk stopped short is open and says so."""
    prog = WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")
    ctx = make_context(prog)

    def gen():
        return KernelGenerator(ctx, max_kernels=2, max_block_ops=3, max_grid=MAX_GRID)
    choices = gen().choices()
    first = gen().groups(choices, False)[0]
    whole = gen()
    everything = list(whole.explore(2, first, choices, math.inf))
    assert not whole.open and len(everything) >= 2
    parts, g, grants = [], gen(), 0
    while grants == 0 or g.open:
        before = g.steps
        parts += g.explore(2, first, choices, 200)
        assert g.steps > before or not g.open  # every grant makes progress or finds nothing is left
        grants += 1
    assert grants > 2 and sorted(map(str, parts)) == sorted(map(str, everything)) and len(set(parts)) == len(parts)
    assert g.steps >= whole.steps  # the kernel level was walked again in the resumption passes


def test_the_cost_rules_threshold_is_the_best_design_of_fewer_kernels_that_verifies(monkeypatch):
    """A cheap design that fails verification (fp16 rmsnorm_linear's one-kernel designs that
    overflow) must not set the bar that drops designs of more kernels: `best_us` verifies the
    designs of fewer kernels fastest first and takes the first that passes; the answers are kept
    for stage 2; with no time left to verify, nothing is cut."""
    from types import SimpleNamespace

    from prism_serve.optimize.pipeline import stages

    prog = WORKLOADS["silu_and_mul"].program(intermediate=40, dtype="float32")
    costed = _listing(prog, get_gpu("h100"), 2, 3)
    one = [(us, d) for us, d, _ in costed.ranked() if len(d.kernels) == 1]
    assert len(one) >= 2
    failing = one[0][1]
    asked = []

    def verify(prog_, design, gpu):
        asked.append(design)
        ok = SimpleNamespace(ok=design != failing)
        return ok, ok, 0.0

    monkeypatch.setattr(stages, "verify_design", verify)
    assert costed.best_us(2) == one[1][0] >= one[0][0]
    assert asked == [failing, one[1][1]] and set(costed.verdicts) == set(asked)
    assert costed.best_us(1) == float("inf")  # no design of fewer than one kernel
    fresh = _Costed(prog, get_gpu("h100"), BUCKETS, SearchStats())
    fresh.items, fresh.deadline = costed.items, time.perf_counter() - 1
    assert fresh.best_us(2) == float("inf") and not fresh.verdicts


def test_a_depth_keeps_to_its_share_of_the_work():
    """Depth 1 gets DEPTH_SHARE of the work (and uses it: its subtrees are open when it runs
    out), so depth 2 still gets the rest and yields designs; the whole search spends its work,
    each subtree past its grant by at most one state's candidates and one design."""
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32, dtype="float32")
    work = 400_000
    costed = generate(prog, get_gpu("h100"), (4,), max_kernels=2, max_block_ops=6, work=work)
    kernels = [len(d.kernels) for d in costed.designs]
    assert 1 in kernels and 2 in kernels, kernels
    assert costed.stats.open_subtrees > 0
    assert work * DEPTH_SHARE <= costed.stats.steps <= work * 1.2

