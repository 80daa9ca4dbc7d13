"""The kernel-level generator: designs built one kernel at a time over the tensors so far.

From the Program's inputs, each step adds one kernel that reads any tensors produced so far:
a library op (one IR op, its result a new kernel tensor) or a graph-defined kernel from
`block.BlockGenerator` for one grid (an ordered set of index labels, in canonical label order,
or joint axes over labels that share no tensor, at most `max_grid` axes) and one for-loop label (None, or a label some op reduces), optionally
split across one more grid axis; a graph-defined kernel has at most `max_block_ops` block ops,
or, as the one kernel of a one-kernel design, at least as many as the Program has and one per
matmul, for a factor applied after it (`alone_ops`). A kernel may recompute what an earlier one
computed (its block graph reads the inputs again). A kernel that writes a tensor whose abstract
expression is already available is pruned as ``canonical``, and so is a complete design with a
dead kernel (it writes no output and no later kernel reads what it writes: the design without it
comes at a lower depth); library results meet the same rules as block ops.

The search is split into subtrees: the designs of one depth (number of kernels) whose first
kernel is of one group (library ops, or one (grid, loop) choice; `groups`). Subtrees are
independent, so worker processes take one each; a `KernelGenerator` walks one subtree
(`explore`) and caches its block enumerations per (tensors, grid, loop).

The budget is work, not time: steps, those the block walks spend (`block.py`) plus DESIGN_STEPS
per design handed out (costing a design is most of a search's time). `explore` gets an allowance of
steps; its first pass shares it among the block enumerations it opens (each gets the pass's
steps left divided by `pending`), one that spends its share pauses, and resumption passes
continue the paused ones and walk the kernel level again for the designs their new block graphs
complete (each design is handed out once). The kernel of a one-kernel design is walked as two
enumerations, each with its own share: its block graphs over the tensors' own iterators, then
those that read an iterator at other maps (`_blocks`); and its enumerations leave DESIGN_STEPS
of their share per block graph they complete, for the pass to cost it (`_advance`). A later
`explore` grants more steps and resumes where the last one stopped. So what a subtree yields is
a function of the steps granted, never of the machine's speed or load or of the process that
walks it. A wall-clock `deadline` remains as a safety net only (`stopped`).

With a `DesignBound`, a search that ranks (rather than lists) designs drops a partial design
whose lower bound on modeled time already exceeds the best complete design with fewer kernels
(`best_us`, which the driver sets per depth): the ``cost`` rule (see `bound.py`).

Not enumerated: a grid axis over a label no output carries, two loops in one kernel, stores of
a value that is both consumed and written by the same kernel unless it equals an output, the
combine kernel of a split (derived by `split.py`), and a store's omap (it follows the stored
value's labels, the one map under which the value's tile fits the tensor's without renaming an
index; an intermediate is stored in its value's dim order, so no other layout is tried).
"""

from __future__ import annotations

import itertools
import math
import time
from functools import cached_property
from typing import Iterator

from prism_serve.optimize.generate.block import (ALL, ROWS, TILES, BlockGenerator, Counts, Value, base_label,
                                                 input_iterators)
from prism_serve.optimize.generate.abstract import term_parts
from prism_serve.optimize.generate.bound import DesignBound
from prism_serve.optimize.generate.context import Context
from prism_serve.optimize.generate.axes import axis_labels, grid_labels, joint_axis
from prism_serve.optimize.generate.design import BlockOp, BlockSpec, Design, LibrarySpec, intermediate_type, reads, writes
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import INDEX_DTYPES, NUM_TOKENS

LIBRARY = "library"  # the first-kernel group of library ops (see `KernelGenerator.groups`)
# Steps charged per design handed out, against one per block-walk state: costing a design (a
# descent over its symbols per bucket) takes about as long as expanding this many states
# (`scripts/bench_search.py` reports both counts and the seconds).
DESIGN_STEPS = 10_000
# Below depth 1, each block enumeration of a first pass gets 1/DEEP_PENDING of the steps left. An
# enumeration pays a fixed cost before its first graph (judging the ops over its kernel tensors:
# 2,300 steps for MoE's last kernel); at 1/16 the later ones of a subtree got less than that and
# completed nothing (MoE's two-kernel design was generated at 1.0M and 1.5M steps of work, not at
# 400k, 800k or 1.2M); at 1/4 it is generated from 400k on, and the five Prism workloads' best
# designs stay the same at 400k and at 3M.
DEEP_PENDING = 4


class KernelGenerator:
    """The walk of one subtree (`explore`); `choices` and `groups` say which subtrees there are."""

    def __init__(self, ctx: Context, *, max_kernels: int, max_block_ops: int, max_grid: int,
                 bound: DesignBound | None = None, deadline: float = math.inf):
        self.ctx, self.max_kernels, self.max_block_ops, self.max_grid = ctx, max_kernels, max_block_ops, max_grid
        # the kernel of a one-kernel design holds the whole Program: it may have as many ops as the
        # Program has (an MLP with its RMSNorm has 9), its own fused form among them, and one more
        # per matmul, for a factor moved past it (1/rms after both of an MLP's projections: 11)
        self.alone_ops = max(max_block_ops, sum(n.op not in ("input", "const") for n in ctx.flat.nodes)
                             + sum(n.op == Op.MATMUL for n in ctx.flat.nodes))
        if ctx.indexing.slices or ctx.indexing.concats:  # slices moved down to the loads take more ops;
            # the bound on ops still needed (`BlockGenerator._ops_needed`) counts each finished output
            # but one as a value to join, so a kernel writing all of them has that many ops of slack
            self.alone_ops = max(self.alone_ops, _target_ops(ctx) + len(ctx.outputs) - 1)
        self.deadline = deadline  # wall clock (perf_counter): a safety net, past it the walk stops
        self.bound = bound
        self.best_us = math.inf  # the best modeled design with fewer kernels than the current depth
        self._own = Counts()  # the kernel level's own verdicts (choices, library ops, recomputed stores)
        self.block_graphs = 0
        self.kernel_graphs = 0
        self.steps = 0  # spent so far: by the cached block enumerations, and per design handed out
        self.stopped = False  # the wall-clock deadline passed
        self._cache: dict = {}  # per (tensors, grid, loop): [completions so far, generator, its walk or None]
        self.pending = 1  # block enumerations still to run in this pass: each gets an equal share of the steps
        self._floor = 1  # what `pending` counts down to (see `_pass`)
        self._pass_limit = math.inf  # `steps` at which the current pass unwinds (set by `explore`)
        self._resumed: set | None = None  # in a resumption pass: the enumerations resumed so far
        self._reached: set = set()  # the enumerations this pass opened or resumed
        self._cut = False  # this pass unwound at its limit
        self._yielded: set[Design] = set()
        self._started = False
        self._choices: list | None = None

    @property
    def counts(self) -> Counts:
        total = Counts()
        total.add(self._own)
        for _, gen, _ in self._cache.values():
            total.add(gen.counts)
        return total

    @property
    def truncated(self) -> int:
        """Block enumerations paused with their share of the steps spent and not finished since."""
        return sum(walk is not None for _, _, walk in self._cache.values())

    @property
    def open(self) -> bool:
        """Whether more steps would walk further: the last pass unwound at its limit, or left
        paused an enumeration it reached (one the walk no longer reaches stays paused for good)."""
        return not self.stopped and (self._cut or any(self._cache[k][2] is not None for k in self._reached))

    def choices(self) -> list[tuple[tuple[str, ...], str | None]]:
        """(grid axes, loop label) per graph-defined kernel: an axis is an output's label, a
        joint axis (`_joint_axes`) or, for a kernel that feeds later ones only (`groups`), a
        feeding axis (MoE's top-k choices, below) and beside one a feeding split (`_feeding_splits`),
        no label split by two axes. Grids that split more labels
        come first, then those of fewer axes, then loops over longer reductions first (an order
        only: what comes sooner); the choice-level shape rule drops grids without the token label
        where tensors have tokens. Judged (and counted) once per generator."""
        if self._choices is not None:
            return self._choices
        ctx = self.ctx
        windows = {lb for lb in ctx.indexing.slices.values()} | {lb for _, lb in ctx.indexing.concats.values()}
        # a grid axis never partitions a dim that a slice or concat makes (it is read whole)
        out_labels = [lb for lb in ctx.labels if lb in self._output_labels
                      and lb not in windows]
        # no loop walks a dim the Program slices: the windowed loads need it whole in the tile
        sliced = {lb for lb, _ in ctx.indexing.slices}
        reduced = [lb for lb in ctx.labels if lb in self._reduced_labels and lb not in sliced]
        has_tokens = any(NUM_TOKENS in v.labels for v in ctx.inputs.values())
        sizes = {lb: d for v in ctx.inputs.values() for lb, d in zip(v.labels, v.type.shape) if isinstance(d, int)}
        reduced.sort(key=lambda lb: -sizes.get(lb, 0))  # a loop over the longest reduction first
        axes = out_labels + self._joint_axes(out_labels) + sorted(self._feeding_axes) + sorted(self._feeding_splits)
        grids = [grid for r in range(min(self.max_grid, len(axes)), 0, -1) for grid in itertools.combinations(axes, r)
                 if len(grid_labels(grid)) == sum(len(axis_labels(a)) for a in grid)  # no label split twice
                 and (self._feeding_axes & set(grid) or not self._feeding_splits & set(grid))]
        # more parallel grids first (more labels split); of those, fewer axes first: a joint axis'
        # block loads what its labels' tensors share once
        grids.sort(key=lambda g: (-len(grid_labels(g)), len(g)))
        out = []
        for grid in grids:
            for loop in [lb for lb in reduced if lb not in grid] + [None]:
                self._own.generated += 1
                if has_tokens and NUM_TOKENS not in grid:
                    self._own.pruned["shape"] += 1
                    continue
                out.append((grid, loop))
        self._choices = out
        return out

    @cached_property
    def _feeding_axes(self) -> frozenset[str]:
        """The grid axes of a kernel that feeds later ones only: the choices an index input holds
        for each token and the Program reduces (MoE's top-k). Such a kernel writes one row per
        (token, choice), which the last kernel weights and sums; the last kernel's grid splits
        output labels only."""
        return frozenset(lb for v in self.ctx.inputs.values() if v.type.dtype in INDEX_DTYPES for lb in v.labels
                         if lb != NUM_TOKENS and lb in self._reduced_labels and lb not in self._output_labels)

    @cached_property
    def _feeding_splits(self) -> frozenset[str]:
        """The labels a feeding kernel's grid may split beside a feeding axis: those the Program
        reduces that only gathered tables hold, not the outputs (MoE's intermediate dim, which w13
        and w2 hold). A block per (token, choice, intermediate block) then reads a window of its
        expert's rows and writes that window of the activation, as vLLM's w13 kernel does; with
        one token and 8 choices the grid has 8 blocks without it."""
        if not self._feeding_axes:
            return frozenset()
        ctx = self.ctx
        windows = {lb for key, made in ctx.indexing.slices.items() for lb in (key[0], made)}
        return frozenset(lb for lb in self._reduced_labels - self._output_labels - windows - ctx.indexing.gathers
                         - {NUM_TOKENS, None}
                         if all(ctx.indexing.gathers & set(v.labels) for v in ctx.inputs.values() if lb in v.labels))

    def _joint_axes(self, out_labels: list[str]) -> list[str]:
        """The joint grid axes (`axes.joint_axis`): each pair of output labels but the tokens
        that no tensor of the Program holds both of, and that no op reduces or gathers, such as
        rotary's q heads and k heads. A joint axis' block holds a slice of each, so it reads
        what their tensors share (the cos / sin rows of its tokens) once for both."""
        from prism_serve.optimize.ir.labels import index_labels
        ctx = self.ctx
        held = [set(lbs) for lbs in index_labels(ctx.flat).dims.values()]
        free = [lb for lb in out_labels if lb != NUM_TOKENS and lb not in self._reduced_labels
                and lb not in ctx.indexing.gathers]
        return [joint_axis(pair) for pair in itertools.combinations(free, 2) if not any(set(pair) <= h for h in held)]

    @cached_property
    def _output_labels(self) -> frozenset[str]:
        """Every index label the Program's outputs hold."""
        from prism_serve.optimize.ir.labels import index_labels
        dims = index_labels(self.ctx.flat).dims
        return frozenset(lb for o in self.ctx.outputs for lb in dims[o])

    @cached_property
    def _reduced_labels(self) -> frozenset[str]:
        """Every index label an op of the Program reduces."""
        return frozenset().union(*_reduced(self.ctx))

    def explore(self, depth: int, first, choices, allowance: float) -> Iterator[Design]:
        """The designs of `depth` kernels whose first kernel is a library op (`first` is LIBRARY)
        or a block kernel of the (grid, loop) `first` of `choices`, for `allowance` more steps.
        The first call walks the subtree once; then, and in later calls, resumption passes continue
        the enumerations that paused, while steps are left and the walk is `open`. Each design is
        yielded once, in the order of the walk."""
        self._pass_limit = self.steps + allowance
        if not self._started:
            self._started = True
            self.pending = self._first_enumerations(first) if depth == 1 else DEEP_PENDING
            self._floor = 1 if depth == 1 else DEEP_PENDING  # see `_pass`
            yield from self._pass(depth, choices, first, None)
        while self.open and self.steps < self._pass_limit:
            self.pending, self._floor = max(1, self.truncated), 1  # the paused ones share what is left
            yield from self._pass(depth, choices, first, set())

    def _first_enumerations(self, first) -> int:
        """How many block enumerations the first kernel of group `first` opens over the inputs."""
        if first == LIBRARY:
            return 1
        return 2 if self._has_rows(self.ctx.inputs, *first) else 1

    def _pass(self, depth: int, choices, first, resumed: set | None) -> Iterator[Design]:
        """One walk of the subtree. A first pass (`resumed` None) opens block enumerations; a
        resumption pass advances each paused one it reaches once (`resumed` collects them).

        At depth 1 a first pass opens the enumerations of the one kernel (`_blocks`: one or two),
        which share the steps: the first gets half where there are two, the last all that is left.
        Deeper, every kernel before the last opens new enumerations after it, as many as the walk
        finds: there `pending` stays at DEEP_PENDING, each enumeration getting that fraction of the
        steps left."""
        self._resumed, self._reached, self._cut = resumed, set(), False
        for d in self._walk((), dict(self.ctx.inputs), frozenset(), depth, choices, first):
            if d not in self._yielded:
                self._yielded.add(d)
                self.steps += DESIGN_STEPS
                yield d

    def _walk(self, kernels: tuple, tensors: dict[str, Value], written: frozenset[str], depth: int,
              choices, first=None) -> Iterator[Design]:
        if written == frozenset(self.ctx.outputs):
            if len(kernels) < depth:
                return
            if _dead_kernel(kernels, self.ctx.outputs):
                self._own.pruned["canonical"] += 1  # the same design without its dead kernel has fewer
            else:
                yield Design(kernels)
            return
        if len(kernels) >= depth or self._over_bound(kernels, tensors, written, depth - len(kernels)):
            return
        if self._out_of_steps():
            return
        for spec, new, outs in self._children(kernels, tensors, written, depth, choices, first):
            yield from self._walk(kernels + (spec,), tensors | new, outs, depth, choices)
            if self._out_of_steps():
                return

    def _out_of_steps(self) -> bool:
        """Past the pass's limit the walk unwinds (the designs that the block graphs enumerated so
        far would complete are not all yielded: costing them is what takes the time); past the
        wall-clock deadline it stops for good."""
        self.stopped |= time.perf_counter() > self.deadline
        self._cut |= self.steps >= self._pass_limit
        return self.stopped or self._cut

    def _children(self, kernels: tuple, tensors: dict[str, Value], written: frozenset[str], depth: int, choices,
                  first) -> Iterator[tuple]:
        """The next kernels of a partial design, as (spec, new kernel tensors, outputs written
        after it), group by group in `groups` order (library ops, or the block graphs of one
        (grid, loop) choice, split or not), those the ``cost`` rule drops left out."""
        last = len(kernels) == depth - 1
        for group in self.groups(choices, last) if first is None else [first]:
            if group == LIBRARY:
                yield from self._library_children(kernels, tensors, written, depth)
            else:
                yield from self._block_children(kernels, tensors, written, depth, group)
            if self._out_of_steps():
                return

    def groups(self, choices, last: bool) -> list:
        """The order in which a kernel's kinds are tried: for a design's last kernel, library ops,
        then the (grid, loop) choices in order, those looping over a feeding axis first (the
        choices of an index input, `choices`: what a feeding kernel left per choice, the last one
        sums) and those splitting one left out; for a kernel that feeds later ones, the choices
        with fewer grid axes first and, among those, without a loop first (what a later kernel
        reads is an intermediate, cheapest as a reduction such as the 1/rms of a row, which
        carries fewer labels; a block walk without a loop is the smaller: rmsnorm_linear's 1/rms
        kernel is its 4th block graph of grid (tokens), its 11,604th of 15,201 with a loop over
        hidden), library ops last (each writes a whole tensor); but before all of them those that
        split a feeding axis, which only a feeding kernel can. An order only: what comes sooner
        within the budget. Of those, the grids that also split an output label other than the
        tokens come last: a kernel that writes a row per (token, choice) gains nothing from tiles
        of the output's hidden dim, and a group further down gets a smaller share of the steps
        (tiny Mixtral's experts design came at 700,000 steps with them last, at 800,000 before)."""
        if last:
            return [LIBRARY, *sorted((c for c in choices if not self._feeding_axes & set(c[0])),
                                     key=lambda c: c[1] not in self._feeding_axes)]
        outputs = self._output_labels - {NUM_TOKENS}

        def order(c):
            feeding = bool(self._feeding_axes & set(c[0]))
            return not feeding, feeding and bool(outputs & set(grid_labels(c[0]))), len(c[0]), c[1] is not None
        return [*sorted(choices, key=order), LIBRARY]

    def _library_children(self, kernels: tuple, tensors: dict[str, Value], written: frozenset[str], depth: int):
        last = len(kernels) == depth - 1
        for spec, new in self._library(tensors, written, len(kernels)):
            outs = written | {o[1:] for o in new if o[1:] in self.ctx.outputs}  # new is keyed by "@name"
            if last and outs != set(self.ctx.outputs):
                continue
            if not self._over_bound(kernels + (spec,), tensors | new, outs, depth - len(kernels) - 1):
                yield spec, new, outs

    def _block_children(self, kernels: tuple, tensors: dict[str, Value], written: frozenset[str], depth: int,
                        choice):
        last = len(kernels) == depth - 1
        grid, loop = choice
        comps = self._blocks(tensors, written, grid, loop, last, not kernels and last)
        # a feeding kernel's graphs that store fewer tensors first: each costs traffic, and one that
        # stores act(gate) * up leaves the last kernel fewer ops than the gate and up apart (the
        # experts' hand-built form; at Qwen3-30B-A3B's dims not reached in 3M steps without this)
        for comp in comps if last else sorted(comps, key=lambda c: len(c.sinks)):
            outs = {o for o in comp.outputs if o}
            if last and not set(self.ctx.outputs) - written <= outs:
                continue
            if not outs and any(v.expr == t.expr for v in comp.sinks for t in tensors.values()):
                self._own.pruned["canonical"] += 1  # recomputes a tensor already stored
                continue
            stores, new = [], {}
            for j, (v, o) in enumerate(zip(comp.sinks, comp.outputs)):
                name = o or f"t{len(kernels)}_{j}"
                stores.append(BlockOp(f"st{j}", "store", (v.ref,), (("tensor", name),)))
                new[f"@{name}"] = Value(f"@{name}", v.type if o else intermediate_type(v.type),
                                        tuple(base_label(lb) for lb in v.labels), v.expr)
            ops = comp.ops + tuple(stores)
            for split in (False, True) if loop else (False,):
                self.kernel_graphs += 1
                spec = BlockSpec(grid, loop, ops, split)
                if not self._over_bound(kernels + (spec,), tensors | new, written | outs,
                                        depth - len(kernels) - 1):
                    yield spec, new, written | outs
            if self.stopped:
                return

    def depth_cut(self, depth: int) -> bool:
        """Whether the cost rule drops every design of `depth` kernels at once (counted once)."""
        return self._over_bound((), self.ctx.inputs, frozenset(), depth)

    def _over_bound(self, kernels: tuple, tensors: dict[str, Value], written, more: int) -> bool:
        """The ``cost`` rule: every completion of `kernels` by `more` kernels (a depth's designs
        have exactly `depth` kernels) is modeled slower than `best_us`."""
        if self.bound is None or math.isinf(self.best_us):
            return False
        types = {ref[1:]: v.type for ref, v in tensors.items() if ref[0] == "@"} | self.ctx.outputs
        if self.bound.lower_us(kernels, types, set(self.ctx.outputs) - written, more) <= self.best_us:
            return False
        self._own.pruned["cost"] += 1
        return True

    def _blocks(self, tensors: dict[str, Value], written: frozenset[str], grid, loop, last: bool, alone: bool):
        """The block graphs of one (grid, loop) over `tensors`; the kernel of a one-kernel design
        (`alone`) may have `alone_ops`, and its block graphs come from two enumerations, each
        metered on its own: those over the tensors' own iterators, then (where a tensor has them)
        those that read an iterator at other maps (`block.TILES`, `block.ROWS`; Prism chooses a
        kernel's input iterators before its block ops). In one walk of both, fp16 rmsnorm_linear's
        fastest form (1/rms applied after the dot) came after 337,000 steps of whole-row graphs; it
        takes 8,000 in its own. A kernel of a deeper design is one enumeration: each already gets
        1/DEEP_PENDING of the steps left, and two would halve that."""
        if not alone:
            return self._enumeration(tensors, written, grid, loop, last, alone, ALL)
        out = self._enumeration(tensors, written, grid, loop, last, alone, TILES)
        if self._has_rows(tensors, grid, loop):
            out = out + self._enumeration(tensors, written, grid, loop, last, alone, ROWS)
        return out

    def _has_rows(self, tensors: dict[str, Value], grid, loop) -> bool:
        """Whether a block of (grid, loop) has iterators over `tensors` other than their own."""
        return bool(input_iterators(self.ctx.oracle, tensors, grid, loop)[1])

    def _enumeration(self, tensors: dict[str, Value], written: frozenset[str], grid, loop, last: bool, alone: bool,
                     iterators: str) -> list:
        key = (frozenset((k, v.expr) for k, v in tensors.items()), written, grid, loop, last, alone, iterators)
        entry = self._cache.get(key)
        if entry is None:
            gen = BlockGenerator(self.ctx.oracle, self.ctx.outputs, tensors, self.ctx.consts, grid, loop,
                                 self.alone_ops if alone else self.max_block_ops, written, outputs_only=last,
                                 iterators=iterators, indexing=self.ctx.indexing)
            entry = self._cache[key] = [[], gen, gen.run()]
            self._advance(key, entry)
        elif self._resumed is not None and entry[2] is not None and key not in self._resumed:
            self._resumed.add(key)
            self._advance(key, entry)
        return entry[0]

    def _advance(self, key, entry: list) -> None:
        """Run a block enumeration for its share of the pass's steps, until it ends or pauses. The
        share of the kernel of a one-kernel design pays for the walk and for costing the designs its
        block graphs are (DESIGN_STEPS each, split or not, charged when the pass hands them out):
        given all the steps left, it completed dozens and the pass could cost the first alone."""
        comps, gen, walk = entry
        self._reached.add(key)
        gen.allowance = max(0.0, self._pass_limit - self.steps) / max(1, self.pending)
        gen.deadline = self.deadline  # a later task may move it (`workers.py`)
        self.pending = max(self._floor, self.pending - 1)
        *_, alone, _ = key  # (tensors, written, grid, loop, last, alone, iterators): see `_enumeration`
        designs_per_graph = (2 if gen.loop else 1) if alone else 0
        before = gen.steps
        try:
            for c in walk:
                if c is None:  # paused: its share is spent
                    return
                comps.append(c)
                gen.allowance -= DESIGN_STEPS * designs_per_graph
                self.block_graphs += 1
                if time.perf_counter() > self.deadline:
                    self.stopped = True
                    return
            entry[2] = None
        finally:
            self.steps += gen.steps - before

    def _library(self, tensors: dict[str, Value], written: frozenset[str], index: int):
        """One IR op over kernel tensors, as a library kernel (same rules as a block op)."""
        gen = BlockGenerator(self.ctx.oracle, self.ctx.outputs, tensors, {}, tuple(self.ctx.labels), None, 1,
                             written, iterators=TILES, library=True,  # whole tensors: no block iterators
                             indexing=self.ctx.indexing)
        for op, ins, attrs in gen.source_candidates():
            self._own.generated += 1
            new, rule = gen._op(op, ins, attrs, "lib")
            if rule is None and any(v.expr == new.expr for v in tensors.values()):
                rule = "canonical"
            if rule:
                self._own.pruned[rule] += 1
                continue
            out = next((o for o, t in self.ctx.outputs.items() if o not in written and t.shape == new.type.shape
                        and self.ctx.oracle.equals(new.expr, o)), None)
            name = out or f"t{index}_0"
            self.kernel_graphs += 1
            yield (LibrarySpec(name, op, tuple(i.ref[1:] for i in ins), attrs),
                   {f"@{name}": Value(f"@{name}", new.type, new.labels, new.expr)})


def _dead_kernel(kernels: tuple, outputs) -> bool:
    """Whether some kernel writes no program output and nothing it writes is read later."""
    for i, k in enumerate(kernels):
        later = set().union(*(reads(j) for j in kernels[i + 1:]))
        if not writes(k) & (set(outputs) | later):
            return True
    return False


def _target_ops(ctx: Context) -> int:
    """The block ops of the targets' terms as a design with slices on its loads builds them: one
    per distinct op and per sliced variable (a windowed load; two for a window of a window)."""
    parts = {p for t in ctx.targets.values() for p in term_parts(t)}
    return sum(p[0] != "const" and (p[0] != "var" or p[1].count("[")) for p in parts) + \
        sum(p[1].count("[") - 1 for p in parts if p[0] == "var" and p[1].count("[") > 1)


def _reduced(ctx: Context):
    from prism_serve.optimize.ir.labels import index_labels
    return index_labels(ctx.flat).reduced.values()
