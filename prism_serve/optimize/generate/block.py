"""The block-level generator: a graph-defined kernel built one block op at a time.

For a grid (an index label per axis, or a joint axis' labels: `axes.axis_labels`) and an
optional for-loop label, `BlockGenerator` walks block graphs depth first. Each step adds one op
over the block's tensors so far, the input iterators over the kernel tensors and the Program's
constants: a unary or binary elementwise op, a sum / mean / max over one labelled dim, a matmul,
or a for-loop accumulator (sum, mean, max, and the online-softmax ``rescaled_sum`` when the
value uses a running max). A reduction over the loop label inside the loop yields a loop-tile
partial that only an accumulator may consume.

Input iterators are enumerated, as Prism's generator does: for each kernel tensor, every imap
(each grid axis partitions a distinct dim of the tensor, or replicates the tile) and every fmap
(the loop walks a dim that no axis partitions, or none: the tile is loaded once, before the
loop), judged by the rules in order (`input_iterators`; ``shape``: the token axis and the token
dim go together, no tile holds every token, the loop walks a labelled fixed dim, a dim read at
another label has that label's extent; ``abstract_expression``: a dim read at another label than
its own, a transposed or mismatched map, reads the tensor at renamed indices, a leaf that no
term of the target has, and a dim held whole where the grid or the loop splits it must be
reduced over a label the Program reduces). Each surviving iterator labels each dim by the index
it is read at, marked whole (`whole_label`) where the grid or the loop splits that label and the
iterator does not, so a whole dim never meets a tile of it. Those that survive besides each
tensor's own maps (``@x``) are in practice an activation's whole row before the loop
(``@x:whole``), its token rows replicated over grid axes that split dims the Program reduces
(``@x:row``: each block computes the rms of whole rows and applies it to its own column tile),
and a weight held whole along the loop's label (``@w:whole``). A reduction over a whole dim is a
full one; a value that still holds one is never stored (its grid axis partitions the tensor).
Stores follow the stored value's labels (omap and fmap): a store at other maps writes a permuted
tensor that no output equals. A walk offers every iterator (`ALL`), or its graphs are split
between two walks (`TILES`: the tensors' own iterators alone; `ROWS`: graphs that read any other
iterator), which the kernel-level generator meters one by one.

Only well-typed candidates are built: unary ops and reductions of each value, elementwise pairs
whose broadcast dims carry one label each, matmuls whose operands' last dims carry the
contracted label (`_typed`). In a float16 kernel a matmul with an operand computed in the block
(or a float32 intermediate) is offered twice: on float16 operands, then on TF32 operands
(`ir.TF32`: float32's range, so x * g of an outlier channel cannot overflow before 1/rms scales
the product). The two are one value for the abstract expression and distinct designs.
Ill-typed pairs are never built; they are neither generated nor pruned, and not counted
anywhere. Each built candidate meets the rules in this order, the first failure counted in
`Counts`:

- ``shape``: types agree (`infer_type`), no tile holds every token, block matmuls have batch
  dims on the grid or the loop (a tile of one: MoE's loop over each token's top-k choices);
- ``schedule``: no post-loop value inside the loop but a running max; one rescale per value;
- ``abstract_expression``: the new tensor's abstract expression (`abstract.py`) is a
  subexpression of the target's; a partial reduction used by anything but its accumulator is not;
- ``canonical``: an op independent of the previous one comes after it in expression order,
  the block does not already hold the value, and a state reached before (same tensors and
  uses) is not expanded again.

The first three rules see the operands' facts only (`Value.facts`), so their verdicts are cached
per operand facts and counted again in every state that offers the same op (each is a pruned
graph), but for ops over kernel tensors and constants alone, judged and counted once. The
iterator maps are judged and counted once per walk that offers them (`ALL`, `ROWS`), also apart
(`Counts.iterators`, `Counts.iterators_kept`).

Two bounds cut the walk without being counted as rules: at most `max_ops` ops (accumulators
aside), and for a design's last kernel (`outputs_only`) a lower bound on the ops it still needs
(`_ops_needed`: unused values to join into its outputs, kinds of op its outputs have and no
value has yet).

The walk is depth first, and the order in which it tries ops decides what comes sooner (never
what comes at all): first the ops whose result is a node of the Program as written (its term and
its layout, `Oracle.literal`), smallest `_key` first, which is the Program's own order; then the
others, those on the newest value first (`_candidates`). The canonical rule admits the order that
always takes the smallest ready op, so the walk goes straight down the Program's own fused form
(24 states for qk_norm_attention's 20-op kernel) where the newest-first order had to back out of
a chain the canonical rule could no longer interleave (10,000+ states, not done in 60 s).

A state whose unused tensors can all be stored (program outputs where the abstract expression
equals an output's, intermediates otherwise; never a loop partial) is a complete kernel. A
consumed value that equals a program output is stored as well (fused_add_rms_norm's residual sum
feeds the norm and is an output), unless it lives inside the loop.

The walk is metered in steps (`steps`): one per candidate op it judges (on its operand facts,
once per generator, and in each state that offers it), and QUERY_STEPS more per candidate
whose abstract expression goes to the e-graph, most of the walk's time. With its `allowance`
spent it pauses at the next state (yields None) and resumes where it stopped once the consumer
grants more; past the search's wall-clock `deadline` (a safety net) it pauses for good. A walk
given the same steps reaches the same graphs whichever process runs it and however busy the
machine is: the search's budget is counted in these steps, not in seconds (see `kernel.py`)."""

from __future__ import annotations

import itertools
import math
import time
import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterator

from prism_serve.errors import ProgramError
from prism_serve.optimize.generate.abstract import Oracle, Term, op_tags, term_parts
from prism_serve.optimize.generate.axes import JOINT, axis_labels, grid_labels, own_maps
from prism_serve.optimize.generate.design import (BINARY, COMMUTATIVE, ROW, UNARY, WHOLE, BlockOp, iterator_ref,
                                                  read_labels, tensor_of)
from prism_serve.optimize.ir.ops import OPS, Op
from prism_serve.optimize.generate.windows import (NO_INDEXING, Indexing, canonical, concat_spec, gather_spec,
                                                   indexed_labels, slice_var)
from prism_serve.optimize.ir.program import (INDEX_DTYPES, NUM_TOKENS, REDUCTIONS, TF32, Node, TensorType, infer_type,
                                             is_tf32)

# Steps per candidate whose abstract expression is asked of the e-graph (the oracle's cache may
# answer it, but which queries that cache holds depends on what else the process walked).
QUERY_STEPS = 10
# Which input iterators a walk offers (see the module's docstring): every one (`ALL`); the tensors'
# own maps alone (`TILES`); or every one, keeping only the block graphs that read an iterator at
# other maps (`ROWS`). `TILES` and `ROWS` split `ALL`'s block graphs between two walks.
ALL, TILES, ROWS = "all", "tiles", "rows"
ITERATOR_SETS = (ALL, TILES, ROWS)
RULES = ("canonical", "shape", "schedule", "hardware", "abstract_expression", "cost")


@dataclass
class Counts:
    generated: int = 0
    pruned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    iterators: int = 0  # input iterator maps judged (in `generated`; those pruned are in `pruned`)
    iterators_kept: int = 0

    def add(self, other: "Counts") -> None:
        self.generated += other.generated
        self.iterators += other.iterators
        self.iterators_kept += other.iterators_kept
        for k, v in other.pruned.items():
            self.pruned[k] += v


@dataclass(frozen=True)
class Value:
    """A tensor the generator can use: a kernel tensor (``@name``), a constant (``#name``) or a
    block op's result, with its logical type, labels, abstract expression and loop facts."""

    ref: str
    type: TensorType
    labels: tuple
    expr: Term
    stage: str = "pre"  # pre | loop | post
    partial: str | None = None  # sum | mean | max over the loop label, awaiting an accumulator
    rescale: str | None = None  # the max accumulator whose running value it uses
    running_max: bool = False  # a max accumulator (readable inside the loop)
    tf32: bool = False  # a matmul on TF32 operands (`ir.TF32`): the same value, another design

    @cached_property
    def whole(self) -> tuple[bool, ...]:
        """Per dim, whether the block holds it whole where a grid axis or the loop splits it."""
        return tuple(_is_whole(lb) for lb in self.labels)

    @cached_property
    def eid(self) -> int:
        """The expression's interned id (tuples do not cache their hash; ids make keys cheap)."""
        return intern(self.expr)

    @cached_property
    def facts(self) -> tuple:
        """What an op's result depends on: the expression, the loop facts, the labels, and the
        name where it matters (a kernel tensor, a constant, a running max that a rescale names)."""
        return (self.ref if self.running_max or self.ref[0] in "@#" else "", self.eid, self.stage, self.partial,
                self.rescale, self.labels)


# The terms of the current generation context by id (`new_terms`); ids count on across contexts,
# so none is ever reused
_INTERNED: dict[Term, int] = {}
_NEXT_ID = itertools.count()
_STAGES = ("pre", "loop", "post")
_UNPLACED = 1 << 30  # the `_key` position of a value that is no node of the Program


def intern(expr: Term) -> int:
    eid = _INTERNED.get(expr)
    if eid is None:
        eid = _INTERNED[expr] = next(_NEXT_ID)
    return eid


def new_terms() -> None:
    """Forget the interned terms: a new generation context starts (`context.make_context`), so
    the table holds one search's terms at a time. A value of an earlier context keeps an id no
    term of this one gets."""
    _INTERNED.clear()
    _TAGS.clear()


@dataclass(frozen=True)
class Completion:
    ops: tuple[BlockOp, ...]
    sinks: tuple[Value, ...]  # the values to store, in op order: the unused ones, and consumed program outputs
    outputs: tuple[str | None, ...]  # per sink: the program output it equals, or None (an intermediate)


class BlockGenerator:
    def __init__(self, oracle: Oracle, outputs: dict[str, TensorType], tensors: dict[str, Value],
                 consts: dict[str, Value], grid: tuple[str, ...], loop: str | None, max_ops: int,
                 written: frozenset[str], allowance: float = math.inf, outputs_only: bool = False,
                 iterators: str = ALL, library: bool = False, indexing: Indexing = NO_INDEXING):
        if iterators not in ITERATOR_SETS:
            raise ValueError(f"iterators must be one of {ITERATOR_SETS}, got {iterators!r}")
        self.oracle, self.outputs, self.grid, self.loop, self.max_ops = oracle, outputs, grid, loop, max_ops
        self.partitioned = grid_labels(grid)  # the labels the grid's axes split (a joint axis splits several)
        self.written, self.allowance, self.outputs_only = written, allowance, outputs_only
        self.iterators = iterators
        self.library = library  # one library op over whole tensors: a reduction reduces its whole dim
        self.indexing = indexing  # the Program's slices, gathers and concats, which designs may rebuild
        # float16 operands of tl.dot overflow past 65504 where float32 does not: a matmul of a
        # computed operand is offered on TF32 operands too (bfloat16 has float32's range)
        self.tf32_dots = any(v.type.dtype == "float16" for v in tensors.values())
        self.steps = 0  # spent so far (see the module's docstring)
        self.deadline = math.inf  # wall clock (perf_counter): the search's safety net; past it the walk pauses
        self.stopped = False
        self._counts = Counts()  # this walk's own verdicts; see `counts`
        # whole rows first: a row statistic before the loop, then the loop, is the usual shape of a
        # design that keeps the loop's operands normalised; other maps last (the order only decides
        # what comes sooner)
        if iterators == TILES:  # the tensors' own iterators only: no other map is enumerated
            own, others = own_iterators(oracle, tensors, grid, loop), []
        else:
            own, others, judged = input_iterators(oracle, tensors, grid, loop)
            self._counts.add(judged)
        rows = [v for v in others if tensor_of(v.ref)[1] in (WHOLE, ROW) and NUM_TOKENS in v.labels]
        self.sources = rows + own + list(consts.values()) + [v for v in others if v not in rows]
        # what the kernel tensors written by earlier kernels hold, term by term (as `_key` spells a
        # term): an op that rebuilds a part of one comes after those that use it (see `_candidates`).
        # The tensors' own leaves are no such part, but a window of one is: MoE's gate rows of w13
        # (a slice) come after the ops that read the silu(gate) * up an earlier kernel stored.
        leaves = {v.expr for v in tensors.values()}
        self._stored_parts = frozenset(repr(t) for v in tensors.values() if v.expr[0] != "var"
                                       for t in term_parts(v.expr) if t[0] != "const" and t not in leaves)
        self.seen: set = set()
        self._keys: dict = {}  # see `_key`
        self.memo: dict = {}
        self._named: dict = {}
        self._source_ops: list | None = None
        self._per_value: dict[tuple, list] = {}
        self._per_pair: dict[tuple, list] = {}

    # --- the walk --------------------------------------------------------
    def run(self) -> Iterator[Completion | None]:
        """The complete kernels, depth first. With its `allowance` spent the walk yields None and
        waits: the consumer may grant more and resume it where it stopped, or drop it."""
        yield from self._walk((), (), {}, None)

    def _charge(self, steps: int) -> None:
        self.steps += steps
        self.allowance -= steps

    def _walk(self, ops: tuple, values: tuple, uses: dict, last: tuple | None) -> Iterator[Completion]:
        done = self._complete(ops, values, uses)
        if done:
            yield done
            if all(o in done.outputs for o in self.outputs if o not in self.written):
                return  # every output is written: more ops would be dead
        left = self.max_ops - len([o for o in ops if o.op != "accum"])
        pending = [v for v in values if v.partial and v.ref not in uses]  # loop partials awaiting an accumulator
        if left <= 0 and not pending:
            return
        if self.outputs_only:  # the bounds on ops left (see `_ops_needed`)
            if self._ops_needed(values, uses) > left:
                return
        # paused: the consumer may grant more steps and resume; past the deadline it stays paused
        while self.allowance <= 0 or time.perf_counter() > self.deadline:
            self.stopped = True
            yield None
        self.stopped = False
        cands = self._candidates(values) if left > 0 else (("accum", (v,), ()) for v in pending)
        held = {(v.eid, v.stage, v.partial, v.whole) for v in values}
        for op, ins, attrs in cands:  # accumulators are not counted against max_ops
            self._counts.generated += 1
            self._charge(1)
            new, rule, bop = self._apply(op, ins, attrs, len(ops))
            if rule is None and (new.eid, new.stage, new.partial, new.whole) in held:
                rule = "canonical"  # the block already holds this value: reuse it
            if rule is None and last is not None and not any(i.ref == last[1] for i in ins) and \
                    self._key(new) <= last[0]:
                rule = "canonical"
            if rule is None:
                nuses = dict(uses)
                for i in ins:
                    nuses[i.ref] = nuses.get(i.ref, 0) + 1
                state = (frozenset((v.eid, v.stage, v.partial, v.rescale, v.whole, v.tf32)
                                   for v in values + (new,)),
                         frozenset(v.eid for v in values + (new,) if v.ref not in nuses))
                if state in self.seen:
                    rule = "canonical"
                else:
                    self.seen.add(state)
            if rule:
                self._counts.pruned[rule] += 1
                continue
            yield from self._walk(ops + (bop,), values + (new,), nuses, (self._key(new), new.ref))

    def _ops_needed(self, values: tuple, uses: dict) -> int:
        """A lower bound on the ops that still complete a design's last kernel: an op joins at most
        two unused values into one, and makes at most one kind of op (`abstract.op_tags`) that the
        outputs' terms have and no value so far has."""
        dangling = sum(v.ref not in uses for v in values)
        missing = self._target_tags.difference(*(_tags(v) for v in values))
        return max(dangling - 1, len(missing))

    @cached_property
    def _target_tags(self) -> frozenset:
        """The op kinds of the outputs still to write that no kernel tensor or constant already has."""
        want = frozenset().union(*(op_tags(self.oracle.targets[o]) for o in self.outputs if o not in self.written))
        return want.difference(*(_tags(v) for v in self.sources))

    def _candidates(self, values: tuple) -> Iterator[tuple[str, tuple, tuple]]:
        """Every well-typed op that reads a block value (ops on the newest value first: designs come
        sooner), then the ops over kernel tensors and constants alone; all of those whose result is
        a node of the Program as written (`Oracle.literal`) before all the others, smallest `_key`
        first, so that the depth-first walk reaches the Program's own fused form early and its
        algebraic variants after (the order only: every op is tried). The rules of `_op` see the
        operands' facts only (`Value.facts`), so their verdict on an op is judged and counted once
        per generator (per operand facts: the ops over kernel tensors and constants; the unary
        ops, reductions and pairs with a kernel tensor or constant of a block value; the pairs of
        two block values), and counted again in every state that offers the same op to the same
        operand facts (a pruned state each), except the ops over kernel tensors and constants alone,
        counted once; only the surviving ops come back, to meet the rules that depend on the
        state (canonical order, values already held)."""
        if self._source_ops is None:
            self._source_ops = self._survivors(self.source_candidates(), ())
        fresh = [v for v in reversed(values) if v.partial is None]
        lists = []
        for i, f in enumerate(fresh):  # each pair of block values once
            facts = f.facts
            if facts not in self._per_value:
                self._per_value[facts] = self._survivors(self._typed(f, self.sources), (f,))
            lists.append((self._per_value[facts], (f,)))
            for b in fresh[i:]:
                key = (facts, b.facts)
                if key not in self._per_pair:
                    self._per_pair[key] = self._survivors(self._pairs(f, [b]), (f, b))
                lists.append((self._per_pair[key], (f, b)))
        for cached, _ in lists:
            cached[2] += 1  # counted in `counts`, not here: adding up Counts per state is a hot path
        if values and values[-1].partial is not None:
            yield "accum", (values[-1],), ()
        # first the ops that rebuild a node of the Program as written, smallest term first (`_key`)
        first = [c for cached, slots in lists for c in _fill(cached[0], slots, True)]
        first += _fill(self._source_ops, (), True)
        # a node computed again (a whole row's loop tile), or a part of what an earlier kernel stored
        # (its 1/rms), comes last: a later kernel reads what an earlier one wrote before it rebuilds it
        held = {self._key(v)[0] for v in values}
        first.sort(key=lambda c: (c[3][0] in held or c[3][1] in self._stored_parts, c[3]))
        for op, ins, attrs, _ in first:
            yield op, ins, attrs
        for v in values[:-1]:
            if v.partial is not None:
                yield "accum", (v,), ()
        for cached, slots in lists:
            yield from _fill(cached[0], slots, False)
        yield from _fill(self._source_ops, (), False)

    def _survivors(self, cands: Iterator, slots: tuple[Value, ...]) -> list:
        """The candidates that pass the rules judged on operand facts alone, with each operand that
        is one of the block values `slots` replaced by its position there (filled in per state)."""
        cands = list(cands)
        built = {}  # the results not judged yet, by the `_apply` memo's key, all rules but the query
        for op, ins, attrs in cands:
            key = (op, attrs, tuple(v.facts for v in ins))
            if key not in self.memo and key not in built:
                built[key] = self._build(op, ins, attrs, "b0")
        asked = [new.expr for new, rule in built.values() if rule is None]
        self._charge(len(cands) + QUERY_STEPS * len(asked))
        self.oracle.prefetch(asked)  # one e-graph run for all
        for key, (new, rule) in built.items():
            self.memo[key] = self._query(new, rule)
        out, pruned = [], Counts()
        for op, ins, attrs in cands:
            pruned.generated += 1
            new, rule, _ = self._apply(op, ins, attrs, 0)
            if rule:
                pruned.pruned[rule] += 1
            else:  # a whole row leads on only through a reduction of it:
                literal = self.oracle.literal(new.expr, reduced=any(_is_whole(lb) for lb in new.labels),
                                              labels=tuple(base_label(lb) for lb in new.labels))
                out.append((op, tuple(next((j for j, s in enumerate(slots) if v is s), v) for v in ins), attrs,
                            self._key(new) if literal else None))
        if not slots:  # ops over kernel tensors and constants: counted once per generator
            self._counts.add(pruned)
            return out
        pruned.generated -= len(out)  # the survivors are counted where the walk takes them
        return [out, pruned, 0]  # the survivors, what the rules pruned, how many states reused them

    @property
    def counts(self) -> Counts:
        """Every candidate judged so far and the rule that pruned it (the cached verdicts counted
        once per state that reused them)."""
        total = Counts()
        total.add(self._counts)
        for cache in (self._per_value, self._per_pair):
            for _, pruned, uses in cache.values():
                for rule, n in pruned.pruned.items():
                    total.pruned[rule] += n * uses
                total.generated += pruned.generated * uses
        return total

    def source_candidates(self) -> Iterator[tuple[str, tuple, tuple]]:
        """Every well-typed op over the kernel tensors and constants alone."""
        for i, v in enumerate(self.sources):  # each pair once: with itself, later tensors, and constants
            if v.type.dtype != "const":
                yield from self._typed(v, [u for j, u in enumerate(self.sources) if j >= i or u.type.dtype == "const"])

    def _typed(self, f: Value, partners: list[Value]) -> Iterator[tuple[str, tuple, tuple]]:
        """The unary ops and reductions of `f` and the binary ops and matmuls that pair `f` (on
        either side) with one of `partners` (`f` itself included) whose index labels fit: an
        elementwise pair whose broadcast dims carry one label each, a matmul whose operands' last
        dims carry the contracted label. Ill-typed pairs are never built, so they are neither
        generated nor pruned (and not counted)."""
        if f.type.dtype in INDEX_DTYPES or f.expr[0] == Op.CONCAT:  # only a gather's index; only stored
            yield from self._pairs(f, partners)
            return
        yield from self._windows(f)
        for u in UNARY:
            yield u, (f,), ()
        for d, lb in enumerate(f.labels):
            if lb is not None:
                for r in REDUCTIONS:
                    yield r, (f,), (("dim", d - len(f.labels)), ("keepdim", True))
        yield from self._pairs(f, partners)

    def _windows(self, f: Value) -> Iterator[tuple[str, tuple, tuple]]:
        """The Program's slices of a tile loaded whole along the sliced dim (a windowed load: a
        load, or a slice of one; never a computed value, `ir/sgraph.py`)."""
        if f.expr[0] != "var" or f.partial or f.type.dtype == "const":
            return
        for d, lb in enumerate(f.labels):
            if lb is None or _is_whole(lb) or (not self.library and (lb in self.partitioned or lb == self.loop)):
                continue
            for (label, (start, stop, step)) in self.indexing.slices:
                if label == lb:
                    yield Op.SLICE, (f,), (("dim", d), ("start", start), ("step", step), ("stop", stop))

    def _indexed(self, f: Value, b: Value) -> Iterator[tuple[str, tuple, tuple]]:
        """A gather of table `f` (a load, or a slice of one) by the loaded index `b`; a concat of
        `f` and `b` as the Program joins values of their labels (it feeds stores only)."""
        if f.type.dtype in INDEX_DTYPES:
            return
        if b.type.dtype in INDEX_DTYPES:
            if f.expr[0] == "var" and b.ref[0] == "@" and f.type.dtype not in INDEX_DTYPES:
                for d, lb in enumerate(f.labels):
                    if lb in self.indexing.gathers:
                        yield Op.GATHER, (f, b), (("dim", d),)
            return
        if f.type.dtype == "const" or b.type.dtype == "const" or f.partial or b.partial:
            return
        for x, y in ((f, b), (b, f)) if b is not f else ((f, f),):
            for il in (False, True):
                joined = self.indexing.concats.get((x.labels, y.labels, il))
                if joined:
                    yield Op.CONCAT, (x, y), (("dim", joined[0]), ("interleave", il))

    def _pairs(self, f: Value, partners: list[Value]) -> Iterator[tuple[str, tuple, tuple]]:
        if self.indexing.slices or self.indexing.gathers or self.indexing.concats:
            for b in partners:
                yield from self._indexed(f, b)
                if f.type.dtype in INDEX_DTYPES and b is not f:
                    yield from self._indexed(b, f)
        if f.type.dtype in INDEX_DTYPES or f.expr[0] == Op.CONCAT:
            return
        for b in partners:
            if b.type.dtype in INDEX_DTYPES or b.expr[0] == Op.CONCAT:
                continue
            if _broadcasts(f.labels, b.labels):
                yield from _binary(f, b)
                if b.ref != f.ref and b.type.dtype != "const":
                    yield from _binary(b, f)
            if b.type.dtype == "const":
                continue
            for x, y in ((f, b), (b, f)) if b.ref != f.ref else ((f, f),):
                if len(x.labels) >= 2 and len(y.labels) >= 2 and x.labels[-1] is not None:
                    for tb in (False, True):
                        if (y.labels[-1] if tb else y.labels[-2]) == x.labels[-1]:
                            yield Op.MATMUL, (x, y), (("transpose_b", tb),)
                            if self.tf32_dots and (_may_leave_half(x) or _may_leave_half(y)):
                                yield Op.MATMUL, (x, y), (("precision", TF32), ("transpose_b", tb))

    def _key(self, v: Value) -> tuple:
        """The canonical order of values (see ``canonical``): a node of the Program as written
        (`Oracle.position`) by its place in the Program, before every other value; then by term,
        whether it holds whole dims but no token rows, stage and partial. Any total order keeps the
        rule sound (the order that always takes the smallest ready op passes it); this one lets the
        walk take the Program's own nodes in the Program's order (a whole token row before its loop
        tiles, whose statistic the loop needs; a whole operand without token rows, such as all of K
        before a loop over keys, after its tiles), so
        its fused form is reached without backtracking, where an order by term alone made the
        walk build one chain (q's RMSNorm) to its end and then forbade the next (k's, whose terms
        sort first): 10,000+ states for qk_norm_attention's one kernel."""
        at = (v.eid, v.labels, v.stage, v.partial)
        key = self._keys.get(at)
        if key is None:
            position = self.oracle.position(v.expr, tuple(base_label(lb) for lb in v.labels))
            key = self._keys[at] = (_UNPLACED if position is None else position, repr(v.expr),
                                    any(v.whole) and NUM_TOKENS not in v.labels, _STAGES.index(v.stage),
                                    v.partial or "", v.whole)
        return key

    # --- one op ----------------------------------------------------------
    def _apply(self, op: str, ins: tuple[Value, ...], attrs: tuple, index: int):
        """(new value, None, its block op) or (None, the rule that prunes it, None)."""
        name = f"b{index}"
        if op == "accum":
            return self._accum(ins[0], name)
        key = (op, attrs, tuple(v.facts for v in ins))
        if key not in self.memo:  # an op's result depends on its operands' facts only
            self.memo[key] = self._op(op, ins, attrs, name)
        new, rule = self.memo[key]
        if rule:
            return None, rule, None
        named = self._named.get((key, index))  # the same result under its name at this position
        if named is None:
            named = self._named[(key, index)] = replace(new, ref=name)
        return named, None, BlockOp(name, op, tuple(i.ref for i in ins), attrs)

    def _op(self, op: str, ins: tuple[Value, ...], attrs: tuple, name: str) -> tuple[Value | None, str | None]:
        return self._query(*self._build(op, ins, attrs, name))

    def _query(self, new: Value | None, rule: str | None) -> tuple[Value | None, str | None]:
        """A built result through the last rule: its abstract expression is within the target's."""
        if rule is None and not self.oracle.within(new.expr):
            return None, "abstract_expression"
        return new, rule

    def _build(self, op: str, ins: tuple[Value, ...], attrs: tuple, name: str) -> tuple[Value | None, str | None]:
        """The op's result and the first rule that prunes it, but the subexpression query."""
        if any(v.partial for v in ins) and self.oracle.enabled:
            return None, "abstract_expression"  # a loop-tile partial is no subexpression of the target
        a = dict(attrs)
        labels = _labels(op, a, ins, self.indexing)
        if labels is None:
            return None, "shape"
        try:
            t = infer_type(Node(name, op, tuple(f"i{j}" for j in range(len(ins))), attrs), [v.type for v in ins])
        except ProgramError:
            return None, "shape"
        if NUM_TOKENS in labels and NUM_TOKENS not in self.partitioned:
            return None, "shape"
        if op == Op.MATMUL and any(lb is not None and lb not in self.partitioned and lb != self.loop for lb in labels[:-2]):
            return None, "shape"
        stages = {v.stage for v in ins}
        if "loop" in stages and any(v.stage == "post" and not v.running_max for v in ins):
            return None, "schedule"
        stage = "loop" if "loop" in stages else "post" if "post" in stages else "pre"
        rescales = {v.rescale for v in ins if v.rescale} | {v.ref for v in ins if v.running_max and stage == "loop"}
        if len(rescales) > 1:
            return None, "schedule"
        expr, reduced = _expr(op, a, ins)
        partial = None
        if reduced is not None:
            if (reduced in self.partitioned and not self.library and not _is_whole(_reduced_dim(op, a, ins))
                    and self.oracle.enabled):
                # the block holds a slice of the reduced dim only
                return None, "abstract_expression"
            if stage == "loop" and reduced == self.loop:
                if op == Op.MEAN:  # accumulate it as a sum, times the constant 1/size after the loop
                    return None, "schedule"
                partial = Op.SUM if op == Op.MATMUL else op
        return Value(name, t, labels, expr, stage, partial, next(iter(rescales), None),
                     tf32=is_tf32(attrs)), None

    def _accum(self, v: Value, name: str):
        kind = v.partial
        if v.rescale:
            if kind != Op.SUM:
                return None, "schedule", None
            kind = "rescaled_sum"
        bop = BlockOp(name, "accum", (v.ref,) + ((v.rescale,) if v.rescale else ()), (("kind", kind),))
        return Value(name, v.type, v.labels, v.expr, "post", None, None, kind == Op.MAX), None, bop

    # --- completion ------------------------------------------------------
    def _complete(self, ops: tuple, values: tuple, uses: dict) -> Completion | None:
        if not ops:
            return None
        unused = [v for v in values if v.ref not in uses]
        if any(v.partial or v.stage == "loop" for v in unused):
            return None
        if any(w and base_label(lb) in self.partitioned for v in unused for lb, w in zip(v.labels, v.whole)):
            return None  # a row's whole dim that a grid axis splits: the block holds no tile of it to store
        if self.loop and not any(o.op == "accum" for o in ops):
            return None
        if self.iterators == ROWS and not any(i[0] == "@" and tensor_of(i)[1] for o in ops for i in o.inputs):
            return None  # the enumeration over the tensors' own iterators (`TILES`) has it
        sinks: list[Value] = []
        outs: list[str | None] = []
        for v in values:  # in op order: every unused value, and a consumed one that is a program output
            if v.ref in uses and (v.partial or v.stage == "loop"):
                continue
            out = next((o for o, t in self.outputs.items() if o not in self.written and o not in outs
                        and t.shape == v.type.shape and self.oracle.equals(v.expr, o)), None)
            if v.ref not in uses or out:
                sinks.append(v)
                outs.append(out)
        if any(outs) and not all(outs) or self.outputs_only and not all(outs):
            return None  # a kernel writes program outputs, or intermediates for later kernels, not both
        stored = set().union(*({base_label(lb) for lb in v.labels} for v in sinks))
        if any(stored.isdisjoint(axis_labels(axis)) for axis in self.grid):  # an axis every store replicates
            return None
        return Completion(tuple(ops), tuple(sinks), tuple(outs))


def input_iterators(oracle: Oracle, tensors: dict[str, Value], grid: tuple[str, ...], loop: str | None
                    ) -> tuple[list[Value], list[Value], Counts]:
    """Every input iterator a block of (grid, loop) may read over `tensors`: the tensors' own (their
    index labels' maps), the others that pass the rules (whole rows, then token rows, then any
    other maps), and what the rules judged of every map enumerated (`iterator_maps`)."""
    extents = _extents(tensors)
    own, others, counts = [], [], Counts()
    cache = _ITERATORS.setdefault(oracle, {})
    for v in tensors.values():
        key = (oracle.enabled, v, grid, loop, extents)
        if key not in cache:
            cache[key] = _iterators(oracle, v, grid, loop, extents)
        mine, theirs, judged = cache[key]
        own += [mine] if mine else []
        others += theirs
        counts.add(judged)
    group = {WHOLE: 0, ROW: 1}
    others.sort(key=lambda v: group.get(tensor_of(v.ref)[1], 2))  # stable: tensor order, then map order
    return own, others, counts


def own_iterators(oracle: Oracle, tensors: dict[str, Value], grid: tuple[str, ...], loop: str | None) -> list[Value]:
    """The tensors' own iterators (their index labels' maps) that pass the rules: those of
    `input_iterators`, without enumerating every other map (a library op's grid has every label
    of the Program, and rotary's ten make millions of maps)."""
    extents = _extents(tensors)
    cache = _OWN_ITERATORS.setdefault(oracle, {})
    own = []
    for v in tensors.values():
        key = (oracle.enabled, v, grid, loop, extents)
        if key not in cache:
            cache[key] = _own_iterator(oracle, v, grid, loop, dict(extents))
        own += [cache[key]] if cache[key] else []
    return own


def _own_iterator(oracle: Oracle, v: Value, grid: tuple[str, ...], loop: str | None, extents: dict) -> Value | None:
    imap, fmap = own_maps(v.labels, grid, loop)
    dims = [d for d in imap if d is not None]
    if len(set(dims)) != len(dims) or fmap in dims:
        return None  # not a map `_iterators` enumerates
    it, rule = _iterator(oracle, v, grid, loop, (imap, fmap), extents)
    return it if rule is None and it.ref == v.ref else None


def _extents(tensors: dict[str, Value]) -> tuple:
    return tuple(sorted({lb: d for v in tensors.values() for lb, d in zip(v.labels, v.type.shape) if lb}.items()))


# per oracle (dropped with it), per (whether its rule is enabled, tensor, grid, loop, extents)
_ITERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OWN_ITERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same, own iterators only


def _iterators(oracle: Oracle, v: Value, grid: tuple[str, ...], loop: str | None, extents: tuple
               ) -> tuple[Value, list[Value], Counts]:
    """One tensor's iterators: every (imap, fmap) pair (each grid axis partitions a distinct dim or
    replicates the tile, the loop walks a dim no axis partitions or none), judged in rule order."""
    counts, own, others = Counts(), None, []
    rank, walks, extent = len(v.labels), loop is not None, dict(extents)
    for imap in itertools.product((None, *range(rank)), repeat=len(grid)):
        dims = [d for d in imap if d is not None]
        if len(set(dims)) != len(dims):
            continue
        for fmap in (None, *(d for d in range(rank) if d not in dims and walks)):
            counts.generated += 1
            counts.iterators += 1
            it, rule = _iterator(oracle, v, grid, loop, (imap, fmap), extent)
            if rule:
                counts.pruned[rule] += 1
            elif it.ref == v.ref:
                own = it
            else:
                others.append(it)
    counts.iterators_kept = len(others) + (own is not None)
    return own, others, counts


def _iterator(oracle: Oracle, v: Value, grid: tuple[str, ...], loop: str | None, maps, extents: dict
              ) -> tuple[Value | None, str | None]:
    """The iterator reading `v` through `maps`, or the rule that prunes it:

    - ``shape``: a token axis partitions a dim other than the tokens, or another axis the tokens;
      the token axis replicates the tokens (one tile would hold every token); a joint axis
      partitions a dim of none of its labels; the loop walks the tokens or an unlabelled dim; a
      dim is read at a label of another extent;
    - ``abstract_expression``: a dim is read at another label than its own (a transposed or
      mismatched map): its term reads the tensor at renamed indices, a leaf that no term of the
      target has; or the tile holds a dim whole that the grid or the loop splits, along a label the
      Program never reduces (the block can neither store it, its axis partitions every output,
      nor reduce it to a subterm of the target).

    Each dim's label is the one it is read at (`design.read_labels`), held whole (`whole_label`)
    where the grid or the loop splits that label and this iterator does not."""
    imap, fmap = maps
    labels = v.labels
    for lb, d in zip(grid, imap):
        if d is None and lb == NUM_TOKENS and NUM_TOKENS in labels:
            return None, "shape"
        if d is not None and (labels[d] is None or (lb == NUM_TOKENS) != (labels[d] == NUM_TOKENS)):
            return None, "shape"
        if d is not None and JOINT in lb and labels[d] not in axis_labels(lb):
            return None, "shape"
    if fmap is not None and labels[fmap] in (None, NUM_TOKENS):
        return None, "shape"
    read = read_labels(labels, grid, loop, maps)
    if any(r != lb and extents.get(r, shape) != shape for r, lb, shape in zip(read, labels, v.type.shape)):
        return None, "shape"
    ref = iterator_ref(v.ref, maps, labels, grid, loop)
    split = {d for d in imap if d is not None} | ({fmap} if fmap is not None else set())
    partitioned = grid_labels(grid)
    tile = tuple(whole_label(lb) if d not in split and lb is not None and (lb in partitioned or lb == loop) else r
                 for d, (lb, r) in enumerate(zip(labels, read)))
    expr = v.expr if read == labels else ("var", ref[1:])
    if not oracle.within(expr):
        return None, "abstract_expression"
    if oracle.enabled and any(_is_whole(lb) and base_label(lb) not in oracle.reduced_labels for lb in tile):
        return None, "abstract_expression"
    return Value(ref, v.type, tile, expr, "pre" if fmap is None else "loop"), None


WHOLE_LABEL = ":whole"


def whole_label(lb: str) -> str:
    """The label of a loop dim held whole (every loop tile at once) before the loop."""
    return lb + WHOLE_LABEL


def _is_whole(lb: str | None) -> bool:
    return bool(lb) and lb.endswith(WHOLE_LABEL)


def base_label(lb: str | None) -> str | None:
    """The index label a (possibly whole) dim label stands for."""
    return lb[:-len(WHOLE_LABEL)] if lb and lb.endswith(WHOLE_LABEL) else lb


def _may_leave_half(v: Value) -> bool:
    """Whether a matmul operand may hold values past float16's range: computed in the block, or a
    float32 kernel tensor (an intermediate an earlier kernel stored)."""
    return v.ref[0] not in "@#" or v.type.dtype == "float32"


def _binary(a: Value, b: Value) -> Iterator[tuple[str, tuple, tuple]]:
    for op in BINARY:
        if op in COMMUTATIVE and b.type.dtype != "const" and b.ref < a.ref:
            continue  # the other order is built instead
        yield op, (a, b), ()


_BROADCASTS: dict[tuple, bool] = {}
_MEMO_MAX = 1 << 20  # entries of `_BROADCASTS` and `_TAGS`; each is emptied when full (pure memos)


def _broadcasts(x: tuple, y: tuple) -> bool:
    """Whether an elementwise op aligns labels `x` and `y` (cached: blocks have few signatures)."""
    key = (x, y)
    ok = _BROADCASTS.get(key)
    if ok is None:
        if len(_BROADCASTS) >= _MEMO_MAX:
            _BROADCASTS.clear()
        ok = _BROADCASTS[key] = all(not p or not q or p == q for p, q in zip(reversed(x), reversed(y)))
    return ok


_TAGS: dict[int, frozenset] = {}


def _tags(v: Value) -> frozenset:
    tags = _TAGS.get(v.eid)
    if tags is None:
        if len(_TAGS) >= _MEMO_MAX:
            _TAGS.clear()
        tags = _TAGS[v.eid] = op_tags(v.expr)
    return tags


def _fill(survivors: list, slots: tuple[Value, ...], literal: bool) -> Iterator[tuple]:
    """Cached survivors (those whose result is a node of the Program as written, with the result's
    `_key`, or the others) with this state's block values filled in."""
    for op, ins, attrs, key in survivors:
        if (key is not None) is literal:
            yield (op, tuple(slots[v] if isinstance(v, int) else v for v in ins), attrs) + ((key,) if literal else ())




def _labels(op: str, a: dict, ins: tuple[Value, ...], indexing: Indexing = NO_INDEXING) -> tuple | None:
    """The result's labels, or None where the operands' labels disagree."""
    if op in (Op.SLICE, Op.GATHER, Op.CONCAT):
        return indexed_labels(op, a, [v.labels for v in ins], indexing)
    if op in BINARY:
        x, y = ins[0].labels, ins[1].labels
        out = []
        for i in range(1, max(len(x), len(y)) + 1):
            p = x[-i] if i <= len(x) else None
            q = y[-i] if i <= len(y) else None
            if p and q and p != q:
                return None
            out.append(p or q)
        return tuple(reversed(out))
    if op in UNARY:
        return ins[0].labels
    if op in REDUCTIONS:
        x, d = ins[0].labels, a["dim"] % len(ins[0].labels)
        return x[:d] + (None,) + x[d + 1:]
    if op == Op.MATMUL:
        x, y = ins[0].labels, ins[1].labels
        k, n = (y[-1], y[-2]) if a["transpose_b"] else (y[-2], y[-1])
        if x[-1] != k or x[-1] is None:
            return None
        batch = _labels(Op.ADD, {}, (Value("", ins[0].type, x[:-2], ()), Value("", ins[1].type, y[:-2], ())))
        if batch is None:
            return None
        return batch + (x[-2], n)
    return None


def _reduced_dim(op: str, a: dict, ins: tuple[Value, ...]) -> str | None:
    """The label of the dim a reduction or a matmul reduces, as its operand carries it."""
    if op in REDUCTIONS:
        return ins[0].labels[a["dim"] % len(ins[0].labels)]
    return ins[0].labels[-1] if op == Op.MATMUL else None


def _expr(op: str, a: dict, ins: tuple[Value, ...]) -> tuple[Term, str | None]:
    """The abstract expression of an op, and the label it reduces (if any)."""
    e = [v.expr for v in ins]
    if op == Op.SLICE:  # of a load: a variable of its own (`windows.slice_var`)
        rank = len(ins[0].labels)
        return ("var", slice_var(e[0][1], a["dim"] - rank, canonical(a["start"], a["stop"], a["step"]))), None
    if op == Op.GATHER:
        return (Op.GATHER, gather_spec(a["dim"] - len(ins[0].labels)), e[0], e[1]), None
    if op == Op.CONCAT:
        return (Op.CONCAT, concat_spec(a["dim"] - len(ins[0].labels), a["interleave"]), e[0], e[1]), None
    if OPS[op].expands_to:  # square: x * x
        return (OPS[op].expands_to, e[0], e[0]), None
    if op in UNARY:
        return (op, e[0]), None
    if op in BINARY:
        return (op, e[0], e[1]), None
    lb = base_label(_reduced_dim(op, a, ins))
    if op in REDUCTIONS:
        return (op, lb, e[0]), lb
    return (Op.SUM, lb, (Op.MUL, e[0], e[1])), lb
