"""The superoptimizer: symbolic search over plans, verification, instantiation.

Stage 1 enumerates, for every segment of the Program's primitive ops, the ways to
run it: a library kernel, or a graph-defined kernel for each `BlockChoice` (grid
labels, for-loop label, split, hoisting). Each candidate passes the pruning rules
in order, each counted in `SearchStats.pruned`:

- ``canonical``: one grid-axis order per set of labels, and no unhoisted twin when
  hoisting changes nothing, so symmetric duplicates are built once;
- ``shape``: symbolic shape compatibility: tiles must be bounded (a token dim is
  always split by the grid), matmul batch dims map to the grid, at most 6 grid dims,
  and the sGraph's sympy shape checks must hold;
- ``schedule``: the block graph must respect the loop (no loop value stored);
- ``hardware``: the finest tiles must fit the GPU's shared memory, registers and tile
  limits (resources only grow from there, so otherwise no assignment fits);
- ``abstract_expression``: every accumulator and intermediate must be a subexpression
  of the target, decided by egglog saturation (cached). Being the costly rule, it runs
  lazily, on the candidates the best-first search reaches.

Plans are explored best-first (A*) on modeled time: a segment not yet expanded
counts at a lower bound (its tensors' bytes at full bandwidth plus a launch), an
expanded one at its best candidate. A candidate that fails a lazy rule or its proof
(Stage 2) is dropped and the plan re-queued. A plan whose segments all hold proven
candidates is built whole, proven again, checked through Triton on fresh inputs
at a small instantiation, and ranked exhaustively per num_tokens bucket.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from prism_serve.errors import SGraphError
from prism_serve.optimize import prune
from prism_serve.optimize.check import NumericVerdict, check_numerics, small_program
from prism_serve.optimize.cost import LAUNCH_US, unfused_us
from prism_serve.optimize.gpus import GpuSpec, get_gpu
from prism_serve.optimize.instantiate import instantiate_plan, rank_plan, segment_instances
from prism_serve.optimize.ir import NUM_TOKENS, Program, bind_shape
from prism_serve.optimize.labels import Labels, index_labels
from prism_serve.optimize.lower import (
    BlockChoice,
    Plan,
    SegmentPlan,
    Unschedulable,
    build,
    op_order,
    segment_program,
    segment_sgraph,
)
from prism_serve.optimize.reference import expand_composites
from prism_serve.optimize.rewrite import loop_form
from prism_serve.optimize.sgraph import BYTES, MAX_GRID_AXES, SGraph, instantiate
from prism_serve.optimize.timing import Timer, cuda_timer
from prism_serve.optimize.tune import Candidate, best_modeled, enumerate_instances, measure, rank
from prism_serve.optimize.verify import ProofResult, prove_equivalent

log = logging.getLogger(__name__)
RULES = ("canonical", "shape", "schedule", "hardware", "abstract_expression")
Progress = Callable[[str, "SearchStats"], None]


@dataclass
class SearchStats:
    states: int = 0  # candidates generated: (segment, choice) pairs, and plans taken from the queue
    plans: int = 0
    pruned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    rejected: dict[str, int] = field(default_factory=lambda: {"proof": 0, "numeric": 0})
    verified: int = 0
    search_s: float = 0.0
    verify_s: float = 0.0
    stopped_by_budget: bool = False

    def to_json(self) -> dict:
        return {"states": self.states, "plans": self.plans, "pruned": dict(self.pruned),
                "rejected": dict(self.rejected), "verified": self.verified, "search_s": self.search_s,
                "verify_s": self.verify_s, "stopped_by_budget": self.stopped_by_budget}


@dataclass(frozen=True)
class Found:
    """A verified sGraph with its best instance per num_tokens bucket (ranked exhaustively)."""

    plan: Plan
    sgraph: SGraph
    proof: ProofResult
    numeric_error: float  # worst over the small-instantiation checks, relative to max |ref|
    kernels: tuple[Candidate, ...]

    def kernel_for(self, num_tokens: int) -> Candidate:
        return next(c for c in self.kernels if c.num_tokens == num_tokens)

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "describe": self.plan.describe(), "sgraph": self.sgraph.to_json(),
                "proof": {"ok": self.proof.ok, "reason": self.proof.reason, "seconds": self.proof.seconds},
                "numeric_error": self.numeric_error,
                "kernels": [{"num_tokens": c.num_tokens, "params": c.assignment, "modeled_us": c.modeled_us,
                             "measured_us": c.measured_us} for c in self.kernels]}


@dataclass(frozen=True)
class OptimizeResult:
    program: Program
    gpu: str
    num_tokens: tuple[int, ...]
    found: tuple[Found, ...]  # fastest (summed over the buckets) first
    unfused_us: dict[int, float]
    stats: SearchStats

    @property
    def best(self) -> Found:
        if not self.found:
            raise SGraphError(f"no verified kernel was found for '{self.program.name}'")
        return self.found[0]

    def to_json(self) -> dict:
        return {"program": self.program.to_json(), "program_hash": self.program.canonical_hash, "gpu": self.gpu,
                "num_tokens": list(self.num_tokens), "unfused_us": {str(k): v for k, v in self.unfused_us.items()},
                "found": [f.to_json() for f in self.found], "stats": self.stats.to_json()}


@dataclass
class _Candidate:
    seg: SegmentPlan
    sgraph: SGraph
    cost: float  # summed over the buckets
    settled: bool = False


class _Search:
    def __init__(self, prog: Program, gpu: GpuSpec, num_tokens: tuple[int, ...], max_segments: int,
                 deadline: float, progress: Progress | None):
        self.prog, self.gpu, self.buckets = prog, gpu, num_tokens
        self.flat = expand_composites(prog)
        self.labels = index_labels(self.flat)
        self.order = op_order(self.flat)
        self.max_segments, self.deadline, self.progress = max_segments, deadline, progress
        self.stats = SearchStats()
        self.candidates: dict[tuple[int, int], list[_Candidate]] = {}  # sorted by cost, once expanded
        self.bounds: dict[tuple[int, int], float] = {}

    # --- costs ---------------------------------------------------------------
    def lower_bound(self, span: tuple[int, int]) -> float:
        if span not in self.bounds:
            seg = segment_program(self.flat, self.order[span[0]:span[1]])
            names = [n.name for n in seg.inputs] + list(seg.outputs)
            total = 0.0
            for nt in self.buckets:
                nbytes = sum(math.prod(bind_shape(seg.types[t].shape, nt)) * BYTES[seg.types[t].dtype] for t in names)
                total += nbytes / (self.gpu.mem_bandwidth_gbs * 1e3) + LAUNCH_US
            self.bounds[span] = total
        return self.bounds[span]

    def value(self, span: tuple[int, int]) -> float:
        if span not in self.candidates:
            return self.lower_bound(span)
        return self.candidates[span][0].cost if self.candidates[span] else math.inf

    # --- Stage 1: candidates of one segment ------------------------------------
    def expand(self, span: tuple[int, int]) -> None:
        seg = segment_program(self.flat, self.order[span[0]:span[1]])
        seg_labels = Labels({n.name: self.labels.dims[n.name] for n in seg.nodes}, self.labels.reduced)
        found: list[_Candidate] = []
        choices: list[BlockChoice | None] = [None] if span[1] - span[0] == 1 else []
        choices += list(_block_choices(seg, seg_labels))
        for choice in choices:
            self.stats.states += 1
            rule = self._cheap_rules(seg, seg_labels, choice)
            if rule:
                self.stats.pruned[rule] += 1
                continue
            plan = SegmentPlan(span[0], span[1], choice)
            try:
                g = segment_sgraph(self.flat, self.labels, plan)
            except Unschedulable as exc:
                self._prune("schedule" if choice else "shape", plan, exc)
                continue
            except SGraphError as exc:
                self._prune("shape", plan, exc)
                continue
            why = prune.shape(g)
            if why:
                self._prune("shape", plan, why)
                continue
            why = prune.hardware(g, self.gpu)
            if why:
                self._prune("hardware", plan, why)
                continue
            best = [best_modeled(g, self.gpu, nt) for nt in self.buckets]
            if any(b is None for b in best):
                self._prune("hardware", plan, "no instance found")
                continue
            found.append(_Candidate(plan, g, sum(b.modeled_us for b in best)))
        self.candidates[span] = sorted(found, key=lambda c: c.cost)

    def _prune(self, rule: str, plan: SegmentPlan, why) -> None:
        self.stats.pruned[rule] += 1
        log.debug("pruned (%s) %s: %s", rule, plan.describe(), why)

    def _cheap_rules(self, seg: Program, labels: Labels, choice: BlockChoice | None) -> str | None:
        """The rules decidable from a choice's labels alone, before lowering: `canonical`, and the
        fast path of `shape` (a token dim outside the grid, a matmul batch dim outside it)."""
        if choice is None:
            return None
        order = prune.label_order(seg, labels)
        if list(choice.grid) != sorted(choice.grid, key=order.index):
            return "canonical"
        if choice.loop and not choice.hoist and loop_form(seg, choice.loop, labels, hoist=False) == \
                loop_form(seg, choice.loop, labels, hoist=True):
            return "canonical"
        has_tokens = any(NUM_TOKENS in labels.dims[n.name] for n in seg.nodes)
        if has_tokens and NUM_TOKENS not in choice.grid or len(choice.grid) + choice.split > MAX_GRID_AXES:
            return "shape"
        batch = {lb for n in seg.nodes if n.op == "matmul" for lb in labels.dims[n.name][:-2] if lb}
        return "shape" if batch - set(choice.grid) else None

    # --- lazy rules and Stage 2 per segment -------------------------------------------
    def settle(self, span: tuple[int, int]) -> None:
        """Run the lazy rule and the proof (Stage 2) on the segment's best candidate; a failure
        drops it, and the next best is settled when the plan comes round again."""
        c = self.candidates[span][0]
        why = prune.abstract_expression(c.sgraph)
        if why:
            self._prune("abstract_expression", c.seg, why)
            self.candidates[span].pop(0)
            return
        t0 = time.perf_counter()
        proof = prove_equivalent(c.sgraph)
        self.stats.verify_s += time.perf_counter() - t0
        if not proof.ok:
            self.stats.rejected["proof"] += 1
            log.info("proof failed for %s: %s", c.seg.describe(), proof.reason)
            self.candidates[span].pop(0)
            return
        # descent only bounds a candidate's best time from above: rank it exhaustively now
        instances = enumerate_instances(c.sgraph, self.gpu)
        c.cost = min(c.cost, sum(rank(c.sgraph, self.gpu, nt, instances)[0].modeled_us for nt in self.buckets))
        c.settled = True
        self.candidates[span].sort(key=lambda x: x.cost)

    # --- plans, best-first ---------------------------------------------------
    def plans(self) -> list[tuple[tuple[int, int], ...]]:
        n = len(self.order)
        out = []
        for k in range(1, min(self.max_segments, n) + 1):
            for cuts in itertools.combinations(range(1, n), k - 1):
                edges = (0, *cuts, n)
                out.append(tuple(zip(edges, edges[1:])))
        return out

    def run(self, top: int) -> list[Plan]:
        queue = [(sum(self.value(s) for s in p), i, p) for i, p in enumerate(self.plans())]
        heapq.heapify(queue)
        accepted: list[Plan] = []
        while queue and len(accepted) < top:
            if time.perf_counter() > self.deadline:
                self.stats.stopped_by_budget = True
                break
            cost, i, spans = heapq.heappop(queue)
            self.stats.states += 1
            self.stats.plans += 1
            now = sum(self.value(s) for s in spans)
            if math.isinf(now):
                continue
            if now > cost + 1e-9:
                heapq.heappush(queue, (now, i, spans))
                continue
            todo = next((s for s in spans if s not in self.candidates), None)
            if todo:
                self.expand(todo)
                if self.progress:
                    self.progress(f"expanded ops {todo[0]}:{todo[1]}", self.stats)
            else:
                unsettled = next((s for s in spans if self.candidates[s] and not self.candidates[s][0].settled),
                                 None)
                if unsettled is None:
                    accepted.append(Plan(tuple(self.candidates[s][0].seg for s in spans)))
                    continue
                self.settle(unsettled)
            heapq.heappush(queue, (sum(self.value(s) for s in spans), i, spans))
        return accepted


def _block_choices(seg: Program, labels: Labels):
    """Every grid / loop / split / hoist choice for a segment (pruning rules sort them out)."""
    order = prune.label_order(seg, labels)
    reduced = {lb for n in seg.nodes for lb in labels.reduced.get(n.name, ())}
    parallel = [lb for lb in order if lb not in reduced and any(lb in labels.dims[o] for o in seg.outputs)]
    loops = [None] + [lb for lb in order if lb in reduced]
    for r in range(1, min(3, len(parallel)) + 1):
        for grid in itertools.permutations(parallel, r):
            for loop in loops:
                for split in ((False, True) if loop else (False,)):
                    for hoist in ((True, False) if loop else (True,)):
                        yield BlockChoice(grid, loop, split, hoist)


def _check_numerics(prog: Program, plan: Plan, gpu: GpuSpec) -> NumericVerdict:
    """The plan rebuilt for small dims, at an instance that exercises every split and loop it can
    (more symbols above 1 first), through Triton on random and adversarial inputs in its dtype."""
    small = small_program(prog)
    values: dict[str, int] = {}
    for _, instances in segment_instances(small, plan, gpu):
        values |= max(instances, key=lambda i: (sum(v > 1 for v in i.values.values()),
                                                -sum(i.values.values()))).values
    return check_numerics(instantiate(build(small, plan), values, gpu))


def _finish(prog: Program, plan: Plan, gpu: GpuSpec, buckets: tuple[int, ...], stats: SearchStats,
            timer: Timer | None = None, measure_top: int = 5) -> Found | None:
    """Stage 2 for a whole plan: build, prove, check numerically, rank per bucket (and on a
    device, time the top candidates and keep the measured winner)."""
    t0 = time.perf_counter()
    g = build(prog, plan)
    proof = prove_equivalent(g)
    if not proof.ok:
        stats.rejected["proof"] += 1
        log.warning("whole-plan proof failed for %s: %s", plan.describe(), proof.reason)
        return None
    verdict = _check_numerics(prog, plan, gpu)
    stats.verify_s += time.perf_counter() - t0
    if not verdict.ok:
        stats.rejected["numeric"] += 1
        log.warning("numeric check failed for %s: %s", plan.describe(), "; ".join(verdict.reasons))
        return None
    error = verdict.worst_error
    stats.verified += 1
    kernels = instantiate_plan(prog, plan, gpu, buckets, g)
    if timer is not None:
        kernels = tuple(_measured(prog, plan, gpu, c, timer, measure_top) for c in kernels)
    return Found(plan, g, proof, error, kernels)


def _measured(prog: Program, plan: Plan, gpu: GpuSpec, modeled: Candidate, timer: Timer, top: int) -> Candidate:
    """On a device: time the `top` modeled candidates of the bucket and keep the measured winner
    (the modeled one, unmeasured, if none runs)."""
    timed = measure(rank_plan(prog, plan, gpu, modeled.num_tokens, top), timer, top)
    return timed[0] if timed else modeled


def optimize(prog: Program, gpu: GpuSpec | str = "h100", num_tokens: Sequence[int] = (16,), *,
             max_segments: int = 3, budget_s: float = 60.0, top: int = 3, known: Sequence[Plan] = (),
             progress: Progress | None = None, timer: Timer | None = None, measure_top: int = 5
             ) -> OptimizeResult:
    """Find verified fused kernels for `prog` on `gpu`, fastest first, each instantiated per
    num_tokens bucket. `known` plans (from an earlier search) are re-instantiated instead of
    searching. The search stops cleanly at `budget_s` with the best found so far.

    `timer(instance, num_tokens) -> us` times candidates on a device; on a CUDA machine it
    defaults to CUDA-event timing of the generated kernel. Measured kernels carry
    `measured_us`; without a device they are modeled only (`measured_us` is None)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if timer is None and torch.cuda.is_available():
        timer = cuda_timer(prog, spec)
    buckets = tuple(sorted(set(num_tokens))) or (1,)
    if any(not isinstance(n, int) or n < 1 for n in buckets):
        raise SGraphError(f"num_tokens buckets must be positive ints, got {list(num_tokens)}")
    start = time.perf_counter()
    stats = SearchStats()
    if known:
        plans = list(known)
    else:
        search = _Search(prog, spec, buckets, max_segments, start + budget_s, progress)
        plans = search.run(top)
        stats = search.stats
    found = []
    for plan in plans:
        f = _finish(prog, plan, spec, buckets, stats, timer, measure_top)
        if f:
            found.append(f)
        if progress:
            progress(f"verified {len(found)} of {len(plans)}", stats)
    stats.search_s = time.perf_counter() - start
    found.sort(key=lambda f: sum(c.measured_us if c.measured_us is not None else c.modeled_us
                                 for c in f.kernels))
    return OptimizeResult(prog, spec.name, buckets, tuple(found),
                          {nt: unfused_us(prog, nt, spec) for nt in buckets}, stats)
