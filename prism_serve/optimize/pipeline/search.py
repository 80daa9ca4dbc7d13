"""Prism's generator as the search driver: generate designs operator by operator, verify them,
instantiate the best. Warmup, `prism-serve optimize` and `scripts/bench_search.py` run it.

Stage 1 (`generate/`): the kernel-level generator adds one kernel at a time (a library op or a
graph-defined kernel whose block graph is itself built one op at a time), pruned per new tensor
by its abstract expression (egglog, cached) and by the canonical, shape, schedule and hardware
rules; every rule is counted in `SearchStats.pruned`. Each complete design is built as a
symbolic sGraph (`generate/design.build`) and ranked by the cost model (coordinate descent over
its symbols per num_tokens bucket) as it comes. A search that ranks (not `all_designs`) also
applies the ``cost`` rule (`bound.py`): a design of more kernels whose lower bound on modeled
time exceeds the best verified design of fewer kernels is dropped (whole depths at once where two
launches already cost more than the best one-kernel design).

The budget of stage 1 is work, counted in steps (`kernel.py`): `work` steps in all, each depth
but the last DEPTH_SHARE of what is left. A depth's subtrees (one per first-kernel group) take
shares in rounds, equal at depth 1 and deeper weighted 1/(k+1) by the group's place k in
`KernelGenerator.groups` (whose order puts the likelier feeding kernels first): what a subtree
leaves unspent is shared, in the next round, among those that spent theirs and would walk
further (each resumed where it paused). The designs come in
round order, then group order, so what is generated is a function of the Program and `work`
alone: not of the machine's speed or load, nor of the number of workers.

Stage 2, fastest modeled first: the egglog proof that the sGraph computes the Program for every
instantiation, then the numeric check of the same design rebuilt at small dims through Triton
(`check.check_numerics`, adversarial inputs included, seeded by the design's canonical hash).
Verified designs are instantiated per bucket; on a device the top candidates are timed and the
measured winner kept. The designs are verified in cost order until `top` pass, so this stage too
is the same for any number of workers.

`budget_s` is a wall-clock safety net over both: generation stops at GENERATE_WALL_SHARE of it,
and a verification starts only while the budget has room for the longest one so far. A search
cut by it says so (`stopped_by_budget`); only then may its result depend on the machine and
the workers. `WORK_PER_S` sets the default work so that one worker on this project's 2-core CPU
machine generates in well under half the budget (`scripts/bench_search.py`).

Both stages use `workers` processes (`workers.py`, spawned: egglog and torch are not fork-safe),
or with one worker this process. Each subtree keeps its own block enumerations, so the counters
too are the same for any number of workers.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.block import RULES
from prism_serve.optimize.generate.bound import DesignBound
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import Design, build
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.instantiate.cost import unfused_us
from prism_serve.optimize.instantiate.timing import Timer, cuda_timer
from prism_serve.optimize.instantiate.tune import SCREEN_DEPTH
from prism_serve.optimize.ir.program import Program
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.pipeline import stages
from prism_serve.optimize.pipeline.instances import Found, Verified, instantiate, rankings
from prism_serve.optimize.pipeline.workers import Config, InlinePool, Pool, default_workers
from prism_serve.optimize.target.gpus import GpuSpec, get_gpu
from prism_serve.optimize.verify.check import NumericVerdict
from prism_serve.optimize.verify.proof import ProofResult

log = logging.getLogger(__name__)
MAX_GRID = 4  # logical grid axes per generated kernel (the sGraph allows up to MAX_GRID_AXES)
DEPTH_SHARE = 0.6  # of the work left, for each depth but the last
MIN_ALLOWANCE = 50  # steps: a round that could grant a subtree fewer is not run
# Default steps of work per second of `budget_s`. Calibrated on this project's 2-core CPU machine
# (`scripts/bench_search.py`, 60 s: 3,000,000 steps): one worker takes 17 to 55 s per Prism
# workload, search and verification together, two workers 14 to 37 s; steps cost 7 to 13 us each.
WORK_PER_S = 50_000
GENERATE_WALL_SHARE = 0.75  # of `budget_s`: the wall-clock safety net for generation (the rest is for
# verifying: the numeric check of a 20-op kernel takes 9 s through the interpreter)
GRACE_S = 10.0  # how long past a deadline the driver waits for a worker's answer (a subtree, a verification)
Progress = Callable[[str, "SearchStats"], None]


@dataclass
class SearchStats:
    kernel_graphs: int = 0  # kernels the kernel-level generator produced (library and graph-defined)
    block_graphs: int = 0  # complete block graphs the block-level generator produced
    generated: int = 0  # candidate ops (block and library) and kernel choices the rules judged
    designs: int = 0  # complete designs (every output written)
    concrete_graphs: int = 0  # symbol assignments the costed symbolic designs stand for
    pruned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    iterator_maps: int = 0  # input iterator maps (imap, fmap) the rules judged (in `generated`)
    iterator_maps_kept: int = 0  # those that passed (each tensor's own maps among them)
    rejected: dict[str, int] = field(default_factory=lambda: {"proof": 0, "numeric": 0})
    verified: int = 0
    workers: int = 1
    work: int = 0  # steps granted to generation
    steps: int = 0  # steps spent
    open_subtrees: int = 0  # subtrees the work ran out on (more steps would have walked them further)
    search_s: float = 0.0
    verify_s: float = 0.0
    static_s: float = 0.0  # compiling chosen instances for the GPU's architecture (`static_check`)
    static_spilled: int = 0  # buckets where every instance `tune.screen` checked spills
    stopped_by_budget: bool = False  # the wall-clock budget cut the search short

    def limit(self) -> str:
        """What cut the search short, as a phrase ("" if nothing did)."""
        if self.stopped_by_budget:
            return "within the time budget"
        return f"within the work budget ({self.open_subtrees} subtrees left open)" if self.open_subtrees else ""

    def to_json(self) -> dict:
        return {"kernel_graphs": self.kernel_graphs, "block_graphs": self.block_graphs, "generated": self.generated,
                "designs": self.designs, "concrete_graphs": self.concrete_graphs, "pruned": dict(self.pruned),
                "iterator_maps": self.iterator_maps, "iterator_maps_kept": self.iterator_maps_kept,
                "rejected": dict(self.rejected), "verified": self.verified, "workers": self.workers,
                "work": self.work, "steps": self.steps, "open_subtrees": self.open_subtrees,
                "search_s": self.search_s, "verify_s": self.verify_s, "static_s": self.static_s,
                "static_spilled": self.static_spilled, "stopped_by_budget": self.stopped_by_budget}


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


class _Costed:
    """The designs built so far (in generation order: fewer kernels first), each through the
    sGraph-level shape and hardware rules and modeled at its best instance per bucket, here
    (`add`) or in a worker (`add_appraised`: its sGraph is rebuilt only if stage 2 needs it)."""

    def __init__(self, prog: Program, gpu: GpuSpec, buckets: tuple[int, ...], stats: SearchStats):
        self.prog, self.gpu, self.buckets, self.stats = prog, gpu, buckets, stats
        self.designs: list[Design] = []  # every design handed in, in order
        self.verdicts: dict[Design, tuple] = {}  # `stages.verify_design`'s answers given while generating
        self.deadline = math.inf  # the last moment `best_us` may verify
        self.items: list[tuple[float, Design, SGraph | None]] = []  # (modeled us, design, sGraph) of those kept
        self._seen: set[str] = set()
        self._handed: set[Design] = set()

    def add(self, d: Design) -> None:
        """Cost a design (one handed in again by a later generation round is ignored)."""
        if self._hand(d):
            b = stages.built(self.prog, d)
            if self._fresh(b and b[1]):
                self._keep(stages.appraise(self.prog, self.gpu, self.buckets, d, *b), b[0])

    def add_appraised(self, a: stages.Appraisal) -> None:
        """Keep a design a worker costed, as `add` would."""
        if self._hand(a.design) and self._fresh(a.key):
            self._keep(a, None)

    def _hand(self, d: Design) -> bool:
        if d in self._handed:
            return False
        self._handed.add(d)
        self.designs.append(d)
        return True

    def _fresh(self, key: str | None) -> bool:
        """Whether a design with this key is new (None: it does not build, counted as ``shape``)."""
        if key is None or key in self._seen:
            self.stats.pruned["shape" if key is None else "canonical"] += 1
            return False
        self._seen.add(key)
        return True

    def _keep(self, a: stages.Appraisal, g: SGraph | None) -> None:
        if a.rule:
            self.stats.pruned[a.rule] += 1
            return
        self.stats.concrete_graphs += a.concrete
        self.items.append((a.us, a.design, g))

    def best_us(self, depth: int) -> float:
        """The cost rule's threshold before `depth`: the best modeled time of the designs so far
        with fewer than `depth` kernels that verify. They are verified here, fastest first, until
        one passes (`verdicts` keeps every answer for stage 2); unverified designs set no bar,
        since a cheap design that fails the proof or the numeric check (fp16 rmsnorm_linear's
        11.61 us one-kernel designs overflow) would drop the safe designs of more kernels. Past
        `deadline` nothing more is verified, and without a verified design nothing is cut."""
        for us, d, _ in self.ranked():
            if len(d.kernels) >= depth:
                continue
            if d not in self.verdicts:
                if time.perf_counter() > self.deadline:
                    return math.inf
                self.verdicts[d] = stages.verify_design(self.prog, d, self.gpu)
            proof, verdict, _ = self.verdicts[d]
            if proof.ok and verdict.ok:
                return us
        return math.inf

    def ranked(self) -> list[tuple[float, Design, SGraph]]:
        return sorted(self.items, key=lambda t: (t[0], t[1].describe()))


def _judge(design: Design, g: SGraph, proof: ProofResult, verdict: NumericVerdict | None, seconds: float,
           gpu: GpuSpec, buckets: tuple[int, ...], stats: SearchStats, keep: int) -> Verified | None:
    """Count a verification's verdict; a verified design comes back with its `keep` best-ranked
    instances per bucket (`instances.rankings`), for `instances.instantiate`."""
    stats.verify_s += seconds
    if not proof.ok:
        stats.rejected["proof"] += 1
        log.info("proof failed for %s: %s", design.describe(), proof.reason)
        return None
    if not verdict.ok:
        stats.rejected["numeric"] += 1
        log.warning("numeric check failed for %s: %s", design.describe(), "; ".join(verdict.reasons))
        return None
    stats.verified += 1
    return Verified(design, g, proof, verdict.worst_error,
                     tuple(tuple(r[:keep]) for r in rankings(g, gpu, buckets, keep)))


def _generate(pool, gen: KernelGenerator, choices: list, costed: _Costed, work: float, deadline: float,
              bound: DesignBound | None, progress: Progress | None) -> None:
    """Stage 1: every depth's subtrees in rounds (see the module's docstring), their designs handed
    to `costed` in round order, then group order (`KernelGenerator.groups`). A depth starts once
    the designs of fewer kernels are costed: the cost rule's threshold (`_Costed.best_us`).
    `gen` is the driver's own generator, for the groups and the cut of whole depths; `choices`
    its `choices()`. Past `deadline` (the safety net) generation stops."""
    stats = costed.stats
    until = time.time() + (deadline - time.perf_counter())
    for depth in range(1, gen.max_kernels + 1):
        share = (work - stats.steps) * (DEPTH_SHARE if depth < gen.max_kernels else 1.0)
        gen.best_us = costed.best_us(depth) if bound else math.inf
        if gen.depth_cut(depth):
            stats.pruned["cost"] += 1
            continue
        groups = gen.groups(choices, depth == 1)
        weight = [1.0 if depth == 1 else 1.0 / (k + 1) for k in range(len(groups))]
        alive, home, spent = list(range(len(groups))), {}, 0
        while alive and share - spent >= MIN_ALLOWANCE * len(alive):
            unit = (share - spent) / sum(weight[k] for k in alive)
            answers = _round(pool, [(k, ("generate", depth, groups[k], unit * weight[k], gen.best_us, until))
                                    for k in alive], home, until + GRACE_S)
            if answers is None:
                log.warning("a generator worker outlived the budget by %.0f s; its subtree is dropped", GRACE_S)
                stats.stopped_by_budget = True
                return
            for sub in answers:
                for a in sub.appraised:
                    costed.add_appraised(a)
                stats.generated += sub.generated
                for rule, k in sub.pruned.items():
                    stats.pruned[rule] += k
                stats.iterator_maps += sub.iterators[0]
                stats.iterator_maps_kept += sub.iterators[1]
                stats.kernel_graphs += sub.kernel_graphs
                stats.block_graphs += sub.block_graphs
                stats.stopped_by_budget |= sub.stopped
                spent += sub.steps
            if progress:
                progress(f"generated {len(costed.designs)} designs", stats)
            if stats.stopped_by_budget:
                stats.steps += spent
                return
            alive = [k for k, sub in zip(alive, answers) if sub.open]
            if not any(sub.steps for sub in answers):
                break
        stats.steps += spent
        stats.open_subtrees += len(alive)


def _round(pool, tasks: list[tuple[int, tuple]], home: dict[int, int], until_wall: float) -> list | None:
    """One round of generation tasks, (group, task), at most one running per worker; a group walked
    before goes to the worker that holds its walk (`home`, which this fills in). The answers in
    task order, or None when they are not all in by `until_wall`."""
    todo, tids = list(tasks), {}
    while True:
        for w in range(pool.size):
            while pool.idle(w):
                j = next((j for j, (k, _) in enumerate(todo) if home.get(k, w) == w), None)
                if j is None:
                    break
                k, task = todo.pop(j)
                tids[k] = pool.submit(*task, worker=w)
                home[k] = w
        if not todo and all(t in pool.done for t in tids.values()):
            return [pool.get(tids[k], until_wall)[1] for k, _ in tasks]
        if not pool.receive(until_wall):
            return None


def _verify(pool, costed, verdicts: dict, deadline: float, take: Callable[..., bool],
            in_time: Callable[[], bool]) -> bool:
    """Stage 2: verifications in cost order, at most one running per worker, read back in cost
    order and handed to `take` until it returns False, so the designs verified do not depend on
    the number of workers; a design in `verdicts` (verified while generating) takes its answer
    from there. None starts unless `in_time()` (before `deadline`, with room for the longest
    verification so far); one that started may finish, but only within GRACE_S of the deadline.
    Returns whether the deadline stopped it."""
    it = iter(costed)
    flight: list = []
    until = time.time() + (deadline - time.perf_counter()) + GRACE_S
    while True:
        while len(flight) < pool.size and in_time():
            item = next(it, None)
            if item is None:
                break
            flight.append((None if item[1] in verdicts else pool.submit("verify", item[1]), item))
        if not flight:
            return not in_time() and next(it, None) is not None
        tid, (_, design, g) = flight.pop(0)
        ok, answer = (True, verdicts[design]) if tid is None else pool.get(tid, until)
        if not ok:
            return True
        if not take(design, g, *answer):
            return False


@dataclass
class SearchRun:
    """The explicit context a search's stages run over (`SEARCH_STAGES`, then `FINISH_STAGES`):
    the checked options, then what each stage adds for the next."""

    prog: Program
    spec: GpuSpec
    buckets: tuple[int, ...]
    config: Config  # what the generator is built from, here and in every worker
    work: int
    budget_s: float
    start: float
    deadline: float  # `start + budget_s`
    top: int
    known: Sequence[Design]
    progress: Progress | None
    timer: Timer | None
    measure_top: int
    all_designs: bool
    static_check: bool
    stats: SearchStats
    ctx: object  # the generation context (None with `known` designs)
    pool: Pool | InlinePool
    costing: _Costed
    gen: KernelGenerator | None = None
    choices: list = field(default_factory=list)  # `gen.choices()`
    costed: list = field(default_factory=list)  # `costing.ranked()`, once every design is in
    verified: list[Verified] = field(default_factory=list)
    longest: float = 0.0  # the longest verification so far: none starts that would likely end past the deadline
    found: list[Found] = field(default_factory=list)

    @property
    def keep(self) -> int:
        """The instances per bucket `instances.instantiate` may look at: what it measures, or the one it
        takes, and as many again as the static check may go down a ranking for."""
        return (self.measure_top if self.timer is not None else 1) + (SCREEN_DEPTH if self.static_check else 0)

    def in_time(self) -> bool:
        return time.perf_counter() + self.longest <= self.deadline

    def take(self, design: Design, g: SGraph | None, proof: ProofResult, verdict: NumericVerdict | None,
             seconds: float) -> bool:
        """Judge one verification (`_verify`'s `take`); whether to go on verifying."""
        self.longest = max(self.longest, seconds)
        g = g or build(self.prog, design)  # a design a worker costed comes without its sGraph
        v = _judge(design, g, proof, verdict, seconds, self.spec, self.buckets, self.stats, self.keep)
        if v:
            self.verified.append(v)
        if self.progress:
            self.progress(f"verified {len(self.verified)}", self.stats)
        return self.all_designs or len(self.verified) < self.top


def _cost_known(run: SearchRun) -> None:
    """Stored designs: rebuilt and costed instead of searching."""
    for d in run.known:
        run.costing.add(d)


def _choose_kernels(run: SearchRun) -> None:
    """The driver's own kernel-level generator and its kernel choices (counted here once)."""
    if run.known:
        return
    run.gen = KernelGenerator(run.ctx, max_kernels=run.config.max_kernels, max_block_ops=run.config.max_block_ops,
                              max_grid=MAX_GRID, bound=run.config.bound)
    run.choices = run.gen.choices()
    run.stats.generated += run.gen.counts.generated
    for rule, k in run.gen.counts.pruned.items():
        run.stats.pruned[rule] += k


def _generate_designs(run: SearchRun) -> None:
    """Stage 1, within GENERATE_WALL_SHARE of the budget."""
    if run.known:
        return
    run.costing.deadline = run.start + run.budget_s * GENERATE_WALL_SHARE
    _generate(run.pool, run.gen, run.choices, run.costing, run.work, run.costing.deadline, run.config.bound,
              run.progress)


def _rank_designs(run: SearchRun) -> None:
    run.stats.designs = len(run.costing.designs)
    run.costed = run.costing.ranked()


def _verify_designs(run: SearchRun) -> None:
    """Stage 2: the fastest modeled designs verified until `top` pass (every one with `all_designs`)."""
    run.stats.stopped_by_budget |= _verify(run.pool, run.costed if run.all_designs or run.top > 0 else [],
                                           run.costing.verdicts, run.deadline, run.take, run.in_time)


def _instantiate_found(run: SearchRun) -> None:
    run.found = instantiate(run.verified, run.spec, run.timer, run.measure_top, run.stats, run.static_check)
    run.stats.search_s = time.perf_counter() - run.start


def _sort_found(run: SearchRun) -> None:
    """Fastest first, summed over the buckets (measured where timed)."""
    run.found.sort(key=lambda f: sum(c.measured_us if c.measured_us is not None else c.modeled_us
                                     for c in f.kernels))


# A search, in order: these run while its worker pool is open, then `FINISH_STAGES` after it closed.
SEARCH_STAGES: tuple[Callable[[SearchRun], None], ...] = (
    _cost_known, _choose_kernels, _generate_designs, _rank_designs, _verify_designs)
FINISH_STAGES: tuple[Callable[[SearchRun], None], ...] = (_instantiate_found, _sort_found)


def optimize(prog: Program, gpu: GpuSpec | str = "h100", num_tokens: Sequence[int] = (16,), *,
             max_kernels: int = 2, max_block_ops: int = 8, budget_s: float = 60.0, work: int | None = None,
             top: int = 3, known: Sequence[Design] = (), progress: Progress | None = None, timer: Timer | None = None,
             measure_top: int = 5, all_designs: bool = False, abstract_rule: bool = True,
             workers: int | None = None, static_check: bool = False, ray: str | None = None) -> OptimizeResult:
    """Find verified fused kernels for `prog` on `gpu`, fastest first, each instantiated per
    num_tokens bucket. `known` designs (stored by an earlier search, possibly for another Program
    of the same family) are rebuilt and verified instead of searching. Generation spends `work`
    steps (default: WORK_PER_S per second of `budget_s`); the search stops cleanly at `budget_s`
    with the best found so far; `all_designs` verifies every generated design instead of stopping
    after `top`; `abstract_rule=False` turns the abstract-expression rule off (to check that it is
    sound). A graph-defined kernel has at most `max_block_ops` ops, the kernel of a one-kernel
    design at least as many as the Program and one per matmul (`KernelGenerator.alone_ops`).

    `workers` processes (default: this machine's cores) generate independent subtrees and verify
    designs in parallel (`workers.py`); what is found does not depend on their number unless the
    wall-clock budget cuts the search (`stopped_by_budget`). With 1, everything runs in this process.
    With `ray` (a cluster address, "auto", or "local" to start one here) they are Ray actors
    (`ray_pool.py`), `workers` of them (default: the cluster's CPUs), with the same result.

    `timer(instance, num_tokens) -> us` times candidates on a device; on a CUDA machine it
    defaults to CUDA-event timing of the generated kernel. Without a device kernels are modeled
    only (`measured_us` is None).

    `static_check` compiles the chosen instances for the GPU's architecture with this process's
    Triton and takes, per bucket, the best-ranked one ptxas does not spill (`tune.screen`; no GPU
    needed), each carrying ptxas's facts (`Candidate.facts`). It runs after the search, outside
    `budget_s` (seconds: one or two child processes; `stats.static_s`)."""
    run = _start(prog, gpu, num_tokens, max_kernels=max_kernels, max_block_ops=max_block_ops, budget_s=budget_s,
                 work=work, top=top, known=known, progress=progress, timer=timer, measure_top=measure_top,
                 all_designs=all_designs, abstract_rule=abstract_rule, workers=workers, static_check=static_check,
                 ray=ray)
    try:
        for stage in SEARCH_STAGES:
            stage(run)
    finally:
        run.pool.close()
    for stage in FINISH_STAGES:
        stage(run)
    return OptimizeResult(prog, run.spec.name, run.buckets, tuple(run.found),
                          {nt: unfused_us(prog, nt, run.spec) for nt in run.buckets}, run.stats)


def _start(prog: Program, gpu: GpuSpec | str, num_tokens: Sequence[int], *, max_kernels: int, max_block_ops: int,
           budget_s: float, work: int | None, top: int, known: Sequence[Design], progress: Progress | None,
           timer: Timer | None, measure_top: int, all_designs: bool, abstract_rule: bool, workers: int | None,
           static_check: bool, ray: str | None = None) -> SearchRun:
    """`optimize`'s options checked, its generation context made and its worker pool started."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    asked, workers = workers, default_workers() if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise SGraphError(f"workers must be a positive int, got {workers!r}")
    if not isinstance(measure_top, int) or measure_top < 1:
        raise SGraphError(f"measure_top must be a positive int, got {measure_top!r}")
    work = round(WORK_PER_S * budget_s) if work is None else work
    if not isinstance(work, int) or work < 0:
        raise SGraphError(f"work must be a non-negative int of steps, got {work!r}")
    if timer is None and torch.cuda.is_available():
        timer = cuda_timer(prog, spec)
    buckets = tuple(sorted(set(num_tokens))) or (1,)
    if any(not isinstance(n, int) or n < 1 for n in buckets):
        raise SGraphError(f"num_tokens buckets must be positive ints, got {list(num_tokens)}")
    start = time.perf_counter()
    deadline = start + budget_s
    stats = SearchStats(workers=workers, work=0 if known else work)
    # a search that ranks may drop designs that cannot beat one of fewer kernels; one that lists does not
    bound = None if all_designs else DesignBound(spec, buckets)
    config = Config(prog, spec, buckets, max_kernels, max_block_ops, MAX_GRID, abstract_rule, bound)
    ctx = None
    if not known:
        ctx = make_context(prog)
        ctx.oracle.enabled = abstract_rule
    if ray is not None:
        from prism_serve.optimize.pipeline.ray_pool import RayPool
        pool = RayPool(config, ray, asked)
        stats.workers = pool.size
    else:
        pool = Pool(workers, config) if workers > 1 and (not known or len(known) > 1) else InlinePool(config, ctx)
    return SearchRun(prog, spec, buckets, config, work, budget_s, start, deadline, top, known, progress, timer,
                     measure_top, all_designs, static_check, stats, ctx, pool, _Costed(prog, spec, buckets, stats))
