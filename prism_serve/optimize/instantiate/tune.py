"""Instantiation by tuning: enumerate power-of-two assignments, rank by the cost model, drop
those ptxas spills for the GPU's target (`screen`, where asked), and on a real GPU time the top
candidates and keep the measured winner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from prism_serve.errors import CodegenError, SGraphError
from prism_serve.optimize.instantiate.cost import kernel_cost, modeled_us, tie_key
from prism_serve.optimize.instantiate.static import KernelFacts, compile_facts
from prism_serve.optimize.ir.program import INDEX_DTYPES, NUM_TOKENS
from prism_serve.optimize.ir.sgraph import BlockKernel, Kernel, SGraph
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.target.instance import Instance, check_kernel, instantiate

log = logging.getLogger(__name__)
TOKEN_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_SPLIT = 1024


@dataclass(frozen=True)
class Candidate:
    instance: Instance
    num_tokens: int
    modeled_us: float
    measured_us: float | None = None
    facts: tuple[KernelFacts, ...] | None = None  # ptxas's, per block kernel (None: not compiled)

    @property
    def assignment(self) -> dict[str, int]:
        return self.instance.values


def split_sizes(g: SGraph) -> dict[str, int]:
    """The size of the data dim each grid / loop symbol divides (a loop's, before any split); where
    one axis divides dims of several sizes (a head block over q's and k's heads), their gcd."""
    sizes: dict[str, int] = {}
    for k in g.kernels:
        if not isinstance(k, BlockKernel):
            continue
        for n in k.loads + k.stores:
            shape = g.tensors[n.attr("tensor")].shape
            maps = n.attr("imap") if n.op == "load" else n.attr("omap")
            for axis, d in zip(k.grid, maps):
                if d is not None and not axis.over_tokens and not shape[d].free_symbols:
                    sizes[axis.symbol] = math.gcd(sizes.get(axis.symbol, 0), int(shape[d]))
            if n.op == "load" and n.attr("fmap") is not None and not shape[n.attr("fmap")].free_symbols:
                sizes.setdefault(k.forloop, int(shape[n.attr("fmap")]))
        for axis in k.grid:  # an axis that partitions nothing (a size-1 label) has extent 1
            if not axis.over_tokens and not any(
                    (n.attr("imap") if n.op == "load" else n.attr("omap"))[k.grid.index(axis)] is not None
                    for n in k.loads + k.stores):
                sizes[axis.symbol] = 1
    return sizes


def symbol_choices(g: SGraph) -> dict[str, tuple[int, ...]]:
    """Candidate values per symbol: token blocks for token axes, else the powers of two (up to
    MAX_SPLIT) that divide the dim the symbol splits, and for a dim of an integer input (MoE's
    top-k choices) also its size, tiles of one: a block matmul holds each choice in a tile of its
    own, which DeepSeek's 6 choices had no power of two for. `instantiate` checks the rest."""
    sizes, tokens, indexed = split_sizes(g), _token_symbols(g), _index_symbols(g)
    out = {}
    for s in g.symbols:
        if s in tokens:
            out[s] = TOKEN_BLOCKS
            continue
        size = sizes.get(s, MAX_SPLIT)
        pow2 = tuple(v for v in _pow2_upto(min(size, MAX_SPLIT)) if sizes.get(s, v) % v == 0)
        out[s] = pow2 + ((size,) if s in indexed and s in sizes and size <= MAX_SPLIT and size not in pow2 else ())
    return out


def _index_symbols(g: SGraph) -> set[str]:
    """The grid and loop symbols that split a dim of an integer input."""
    ints = {n.name for n in g.program.inputs if n.attr("dtype") in INDEX_DTYPES}
    out = set()
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            for n in k.loads:
                if n.attr("tensor") in ints:
                    out |= {a.symbol for a, d in zip(k.grid, n.attr("imap")) if d is not None and not a.over_tokens}
                    if n.attr("fmap") is not None:
                        out.add(k.forloop)
    return out


def _token_symbols(g: SGraph) -> set[str]:
    """The grid symbols of token axes (known by the axis: a dim of 128 has TOKEN_BLOCKS' choices too)."""
    return {a.symbol for k in g.kernels if isinstance(k, BlockKernel) for a in k.grid if a.over_tokens}


def _pow2_upto(n: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(n.bit_length()) if 1 << i <= n)


def _loop_splits(g: SGraph) -> set[str]:
    """Grid symbols that split a loop's dim across blocks (split-K / split-KV)."""
    out = set()
    for k in g.kernels:
        if isinstance(k, BlockKernel) and k.forloop:
            for n in k.loads:
                out |= {a.symbol for a, d in zip(k.grid, n.attr("imap")) if d is not None and d == n.attr("fmap")}
    return out


def finest_assignment(g: SGraph) -> dict[str, int]:
    """The assignment with the smallest tiles: no split of a loop across the grid, every other
    symbol at its largest choice, one token per block. Tile resources only grow from here, so
    if this does not fit a GPU, no assignment does."""
    splits, tokens = _loop_splits(g), _token_symbols(g)
    return {s: 1 if s in splits else c[0] if s in tokens else c[-1] for s, c in symbol_choices(g).items()}


def balanced_assignment(g: SGraph, tile: int = 64, block_tokens: int = 16) -> dict[str, int]:
    """Tiles of about `tile` along every split dim, `block_tokens` tokens per block, no loop split."""
    sizes, splits, choices, tokens = split_sizes(g), _loop_splits(g), symbol_choices(g), _token_symbols(g)
    out = {}
    for s, c in choices.items():
        if s in tokens:
            out[s] = block_tokens
        elif s in splits:
            out[s] = 1
        else:
            fitting = [v for v in c if sizes.get(s, 1) // v >= tile]
            out[s] = fitting[-1] if fitting else c[0]
    return out


def order(c: Candidate, gpu: GpuSpec) -> tuple:
    """How candidates are ranked: modeled time (to 1e-6 us), equal times by `cost.tie_key` (fewer
    bytes requested, fewer registers, more occupancy, fewer warps, less shared memory), never by
    symbol names."""
    return round(c.modeled_us, 6), tie_key(c.instance, gpu, c.num_tokens)


def _better(a: Candidate, b: Candidate, gpu: GpuSpec) -> bool:
    """Whether `a` ranks before `b` (`order`; the tie key is computed only on equal times)."""
    ta, tb = round(a.modeled_us, 6), round(b.modeled_us, 6)
    return ta < tb or (ta == tb and order(a, gpu) < order(b, gpu))


def _ranked(candidates: list[Candidate], gpu: GpuSpec) -> list[Candidate]:
    """`candidates` sorted by `order`, the tie key computed only where modeled times are equal."""
    time = lambda c: round(c.modeled_us, 6)  # noqa: E731
    out: list[Candidate] = []
    for _, group in itertools.groupby(sorted(candidates, key=time), key=time):
        group = list(group)
        out += sorted(group, key=lambda c: order(c, gpu)) if len(group) > 1 else group
    return out


def best_modeled(g: SGraph, gpu: GpuSpec, num_tokens: int) -> Candidate | None:
    """The best instance descent finds from balanced starts (or the finest tiles), or None
    when nothing fits `gpu`; ties by `order`, as in `rank`."""
    times = KernelTimes(g, gpu, num_tokens)
    found = [c for c in (descend(g, gpu, num_tokens, balanced_assignment(g, t), times) for t in (64, 16)) if c]
    found = found or [c for c in [descend(g, gpu, num_tokens, finest_assignment(g), times)] if c]
    return min(found, key=lambda c: order(c, gpu)) if found else None


def kernel_symbols(g: SGraph, k: Kernel) -> tuple[str, ...]:
    """The symbols a kernel's checks and modeled cost read: its grid and loop symbols and those in
    the shapes of the tensors and tiles it touches."""
    if isinstance(k, BlockKernel):
        names = {a.symbol for a in k.grid} | ({k.forloop} if k.forloop else set())
        shapes = [g.tensors[n.attr("tensor")].shape for n in k.loads + k.stores]
        shapes += [t.shape for t in g.block_types(k).values()]
    else:
        names, shapes = set(), [g.tensors[n].shape for n in (k.op.name, *k.op.inputs)]
    names |= {str(s) for shape in shapes for d in shape for s in getattr(d, "free_symbols", ())}
    return tuple(sorted(names - {NUM_TOKENS}))


class KernelTimes:
    """Modeled time of assignments of one sGraph at one num_tokens, memoised per kernel by the
    values of the symbols it reads (`kernel_symbols`): checks and cost are per kernel, so a move
    of one symbol re-evaluates only the kernels that read it. None for an assignment that breaks
    a kernel's check (`sgraph.check_kernel`); a time is `modeled_us` of its instance."""

    def __init__(self, g: SGraph, gpu: GpuSpec, num_tokens: int):
        self.g, self.gpu, self.num_tokens = g, gpu, num_tokens
        self.kernels = [(i, k, kernel_symbols(g, k)) for i, k in enumerate(g.kernels)]
        self._memo: dict[tuple, float | None] = {}

    def __call__(self, values: dict[str, int]) -> float | None:
        total = 0.0
        for i, k, names in self.kernels:
            key = (i, tuple(values[s] for s in names))
            if key not in self._memo:
                self._memo[key] = self._kernel_us(k, values)
            t = self._memo[key]
            if t is None:
                return None
            total += t
        return total

    def _kernel_us(self, k: Kernel, values: dict[str, int]) -> float | None:
        if isinstance(k, BlockKernel):
            try:
                check_kernel(self.g, k, values, self.gpu)
            except SGraphError:
                return None
        inst = Instance(self.g, tuple(sorted(values.items())), self.gpu.name)  # checked per kernel above
        return kernel_cost(inst, k, self.num_tokens, self.gpu).time_us

    def candidate(self, values: dict[str, int], us: float) -> Candidate:
        return Candidate(Instance(self.g, tuple(sorted(values.items())), self.gpu.name), self.num_tokens, us)


def _coupled(g: SGraph) -> list[tuple[str, str]]:
    """(split, loop) symbol pairs that divide the same dim: descent moves them jointly."""
    pairs = []
    for k in g.kernels:
        if isinstance(k, BlockKernel) and k.forloop:
            pairs += [(a.symbol, k.forloop) for a in k.grid if a.symbol in _loop_splits(g)]
    return pairs


PAIR_RADIUS = 3  # a joint move changes each of its two symbols by at most this many choices


def _pair_moves(values: dict[str, int], choices: dict[str, tuple[int, ...]], times: KernelTimes
                ) -> list[dict[str, int]]:
    """Joint moves of two symbols of one kernel (a grid tile with the loop's step, say), each by
    at most PAIR_RADIUS choices from `values`: where a kernel's resource limits bind, single
    moves stall on a ridge that these cross."""
    def near(s: str) -> list[int]:
        c = choices[s]
        i = c.index(values[s]) if values[s] in c else 0
        return [v for v in c[max(0, i - PAIR_RADIUS):i + PAIR_RADIUS + 1] if v != values[s]]

    pairs = sorted({(a, b) for _, _, names in times.kernels for i, a in enumerate(names) for b in names[i + 1:]})
    return [{a: va, b: vb} for a, b in pairs for va in near(a) for vb in near(b)]


def descend(g: SGraph, gpu: GpuSpec, num_tokens: int, start: dict[str, int],
            times: KernelTimes | None = None) -> Candidate | None:
    """Coordinate descent on modeled time from a valid `start`, over `symbol_choices` one symbol
    at a time and coupled (split, loop) pairs jointly, and where those stall, over any two
    symbols of one kernel jointly: a cheap stand-in for `rank` while searching. A move is taken
    when it ranks before the current best by `order`, so equal times move to fewer bytes
    requested, fewer registers and more occupancy as `rank` would. `times` (shared by the starts
    of one search) memoises the kernels' times."""
    times = times or KernelTimes(g, gpu, num_tokens)
    choices = symbol_choices(g)
    singles = [{s: v} for s in g.symbols for v in choices[s]] + [
        {a: va, b: vb} for a, b in _coupled(g) for va in choices[a] for vb in choices[b]]
    values = dict(start)
    us = times(values) if set(values) == set(g.symbols) else None
    if us is None:
        return None
    best = times.candidate(values, us)
    while True:
        moved = _sweep(best, singles, times, gpu)
        if moved is None:
            moved = _sweep(best, _pair_moves(best.assignment, choices, times), times, gpu)
        if moved is None:
            return Candidate(instantiate(g, best.assignment, gpu), num_tokens, best.modeled_us)
        best = moved


def _sweep(best: Candidate, moves: list[dict[str, int]], times: KernelTimes, gpu: GpuSpec) -> Candidate | None:
    """One pass over `moves`, each from the best so far: the better candidate, or None if none was."""
    start = best
    for m in moves:
        values = best.assignment | m
        if values == best.assignment:
            continue
        us = times(values)
        if us is None:
            continue
        cand = times.candidate(values, us)
        if _better(cand, best, gpu):
            best = cand
    return None if best is start else best


def with_neighbours(g: SGraph, gpu: GpuSpec, best: Candidate, open_: bool = False) -> list[Candidate]:
    """`best`, then the valid instances one descent move from it (one symbol to any choice, or two
    symbols of one kernel by at most PAIR_RADIUS choices each), ranked as `rank` ranks, or for a
    bucket that also serves every larger size (`open_`) as `rank_open` ranks around `best`: a
    short ranking for a design too large to enumerate, for `screen` and `measure` to go down."""
    times = KernelTimes(g, gpu, best.num_tokens)
    choices = symbol_choices(g)
    moves = [{s: v} for s in g.symbols for v in choices[s]] + _pair_moves(best.assignment, choices, times)
    seen = {tuple(sorted(best.assignment.items()))}
    near = []
    for m in moves:
        values = best.assignment | m
        key = tuple(sorted(values.items()))
        if key in seen:
            continue
        seen.add(key)
        us = times(values)
        if us is not None:
            near.append(Candidate(instantiate(g, values, gpu), best.num_tokens, us))
    near = _ranked(near, gpu)
    return [best, *(_scaling_first(near, gpu, best.modeled_us) if open_ else near)]


def enumerate_instances(g: SGraph, gpu: GpuSpec) -> list[Instance]:
    """Every valid power-of-two instance of `g` on `gpu` (those that divide and fit). Each kernel's
    checks run once per value of the symbols it reads (`KernelTimes`' memo), not once per
    assignment: a two-kernel design's product of choices is mostly the other kernel's."""
    choices = symbol_choices(g)
    names = list(choices)
    times = KernelTimes(g, gpu, 1)  # None where a kernel's check fails; the time itself is not used
    out = []
    for combo in itertools.product(*(choices[s] for s in names)):
        values = dict(zip(names, combo))
        if times(values) is not None:
            try:  # the rest of `instantiate`'s checks (an intermediate only a library kernel touches)
                out.append(instantiate(g, values, gpu))
            except SGraphError:
                continue
    return out


def rank(g: SGraph, gpu: GpuSpec, num_tokens: int, instances: Sequence[Instance] | None = None) -> list[Candidate]:
    """Valid instances ranked by modeled time at `num_tokens`, fastest first; equal times by
    `cost.tie_key` (fewer bytes requested, fewer registers, more occupancy), never by symbol names."""
    instances = enumerate_instances(g, gpu) if instances is None else instances
    if not instances:
        raise SGraphError(f"sGraph '{g.name}': no power-of-two assignment divides its shapes and fits {gpu.name}")
    return _ranked([Candidate(i, num_tokens, modeled_us(i, num_tokens, gpu)) for i in instances], gpu)


# The last num_tokens bucket's kernel also serves every larger size (warmup.bucket_ranges). Near
# its tuning size, a kernel of one-element tiles can model a little faster than one of whole rows
# (more blocks reach more bandwidth) and then scale terribly: OLMo 2's silu_and_mul, tuned at 8
# tokens, took 1 x 1 tiles (1.87 us against 1.90 at 8 tokens, 448 us against 4.8 at 4096) and ran
# vLLM's 8192-token profile pass as 2M blocks. Within NEAR_TIE of the best at the tuning size (the
# roofline is no closer than that), the instance modeled fastest at the probe size goes first.
NEAR_TIE, SCALE_PROBE, PROBE_TOKENS = 1.02, 16, 4096


def rank_open(g: SGraph, gpu: GpuSpec, num_tokens: int, instances: Sequence[Instance] | None = None
              ) -> list[Candidate]:
    """`rank` for a bucket that also serves every larger num_tokens: the instances within NEAR_TIE
    of the best modeled time at `num_tokens` first, ordered by modeled time at
    max(SCALE_PROBE x num_tokens, PROBE_TOKENS) (then as `rank`), the others after, as `rank`."""
    ranked = rank(g, gpu, num_tokens, instances)
    return _scaling_first(ranked, gpu, ranked[0].modeled_us) if num_tokens and ranked else ranked


def _scaling_first(ranked: list[Candidate], gpu: GpuSpec, fastest_us: float) -> list[Candidate]:
    """`ranked` (ranked by `rank`) with those within NEAR_TIE of `fastest_us` first, ordered by
    modeled time at max(SCALE_PROBE x num_tokens, PROBE_TOKENS), stable (ties stay ranked)."""
    if not ranked:
        return ranked
    probe = max(SCALE_PROBE * ranked[0].num_tokens, PROBE_TOKENS)
    near = [c for c in ranked if c.modeled_us <= fastest_us * NEAR_TIE]
    first = sorted(near, key=lambda c: round(modeled_us(c.instance, probe, gpu), 6))
    return first + ranked[len(near):]


def measure(candidates: Sequence[Candidate], timer: Callable[[Instance, int], float], top: int = 5) -> list[Candidate]:
    """Time the `top` modeled candidates with `timer(instance, num_tokens) -> us`; fastest measured first.
    A candidate whose kernel fails to compile or run is dropped with a log line."""
    timed = []
    for c in candidates[:top]:
        try:
            timed.append(Candidate(c.instance, c.num_tokens, c.modeled_us, timer(c.instance, c.num_tokens), c.facts))
        except Exception as exc:  # a compile failure of one candidate must not stop tuning
            log.warning("candidate %s failed on the device: %s", c.assignment, exc)
    return sorted(timed, key=lambda c: c.measured_us)


# How far past the candidates it wants `screen` looks down a bucket's ranking for ones ptxas does
# not spill: the next-ranked instances differ in a tile or the warps, where ptxas's choices jump
# (issue 13's notes: 4 warps 212 registers, 8 warps 94, for one rmsnorm_linear tile on sm_80).
SCREEN_DEPTH = 8


def screen(ranked: Sequence[Sequence[Candidate]], capability: int, want: int = 1) -> list[list[Candidate]]:
    """Per bucket's ranking, its first `want` candidates whose block kernels ptxas compiles for
    sm_`capability` without spilling (`KernelFacts.spills`), in rank order, each carrying its facts.
    The resource model estimates registers; ptxas decides, and its choices differ between Triton
    releases (a kernel the model chose spills under Triton 3.6 and not under 3.9), so the
    compiler this process would launch with has the last word.

    Compiles in at most two rounds (the first `want` of each bucket, then SCREEN_DEPTH deeper
    where too few were clean), each in one child process; an instance several buckets rank
    compiles once. A bucket whose checked candidates all spill keeps the least-spilling one (ties
    by rank), with a warning. An instance Triton cannot compile for the target is passed over;
    a bucket where none compiled takes its first unchecked candidate (facts None), with a warning.
    Where nothing compiles here (no ptxas in the wheel, an architecture this Triton does not
    know: the first round fails), a bucket takes its unchecked candidates in rank order, with a
    warning."""
    if want < 1:
        raise SGraphError(f"screen wants at least one candidate per bucket, got {want}")
    facts: dict[tuple, tuple[KernelFacts, ...] | None] = {}  # None: does not compile for the target
    seen = [0] * len(ranked)  # how deep each bucket's ranking has been compiled
    unavailable = False
    for depth in (want, want + SCREEN_DEPTH):
        todo, deeper = {}, list(seen)
        for b, cands in enumerate(ranked):
            if len(_clean(cands[:seen[b]], facts)) < want:
                todo.update((_key(c), c.instance) for c in cands[seen[b]:depth] if _key(c) not in facts)
                deeper[b] = min(depth, len(cands))
        if not todo:  # what the buckets need was compiled for another bucket
            seen = deeper
            break
        compiled = _compile(todo, capability, works=any(f is not None for f in facts.values()))
        if compiled is None:
            unavailable = True
            break
        facts.update(compiled)
        seen = deeper
    return [_pick(cands[:seen[b]], cands[seen[b]:], facts, want, unavailable, capability)
            for b, cands in enumerate(ranked)]


COMPILE_ERRORS = (CodegenError, subprocess.SubprocessError, OSError)


def _compile(todo: dict[tuple, Instance], capability: int, works: bool
             ) -> dict[tuple, tuple[KernelFacts, ...] | None] | None:
    """ptxas's facts of each instance (None for one that does not compile for sm_`capability`),
    in one child process, or one each when that fails (one bad kernel fails the batch). Unless
    something compiled before (`works`), None when nothing compiles here (the batch of one, or
    the first two alone, fail)."""
    jobs = list(todo.items())
    try:
        return {key: tuple(f) for (key, _), f in zip(jobs, compile_facts([(i, capability) for _, i in jobs]))}
    except COMPILE_ERRORS as exc:
        if len(jobs) == 1 and not works:
            log.warning("instances not checked by ptxas for sm_%d: %s", capability, exc)
            return None
        log.warning("compiling %d instances for sm_%d failed (%s); compiling them one by one", len(jobs),
                    capability, exc)
    out: dict[tuple, tuple[KernelFacts, ...] | None] = {}
    for key, inst in jobs:
        try:
            out[key] = tuple(compile_facts([(inst, capability)])[0])
        except COMPILE_ERRORS as exc:
            if not works and len(out) == 1 and out[next(iter(out))] is None:
                log.warning("instances not checked by ptxas for sm_%d: %s", capability, exc)
                return None
            log.warning("instance %s does not compile for sm_%d: %s", inst.values, capability, exc)
            out[key] = None
    return out


def _pick(checked: Sequence[Candidate], unchecked: Sequence[Candidate], facts: dict, want: int,
          unavailable: bool, capability: int) -> list[Candidate]:
    """`screen`'s choice for one bucket (see there)."""
    compiled = [dataclasses.replace(c, facts=facts[_key(c)]) for c in checked if facts[_key(c)] is not None]
    clean = _clean(compiled, facts)[:want]
    untried = [c for c in unchecked if _key(c) not in facts]  # some were compiled for another bucket
    if len(clean) == want or (clean and not unavailable):
        return clean
    if unavailable and (clean or untried):
        return clean + untried[:want - len(clean)]
    if compiled:
        least = min(compiled, key=lambda c: sum(f.stack_bytes + f.local_bytes for f in c.facts))
        log.warning("every instance checked at %d tokens spills on sm_%d; keeping %s (%d stack bytes)",
                    least.num_tokens, capability, least.assignment, sum(f.stack_bytes for f in least.facts))
        return [least]
    log.warning("no instance checked compiles for sm_%d; keeping the next unchecked one", capability)
    return untried[:1] or list(checked[:1])


def _clean(cands: Sequence[Candidate], facts: dict) -> list[Candidate]:
    """Those of `cands` compiled without a spill."""
    return [c for c in cands if facts.get(_key(c)) is not None and not any(f.spills for f in facts[_key(c)])]


def _key(c: Candidate) -> tuple:
    return id(c.instance.sgraph), tuple(sorted(c.instance.values.items()))
