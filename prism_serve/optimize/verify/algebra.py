"""Abstract expressions and the rewrite rules of the parallel algebra, as typed egglog terms.

A `T` is a whole tensor, or the tile one block sees of it. Sizes stay symbolic:
a `Sym` names a grid axis or a for-loop, never a number.

- ``part(x, d, s)``: the slice of ``x`` along dim ``d`` (counted from the right, so
  broadcasting keeps it stable) that the index of ``s`` selects.
- ``red_sum(x, s)`` / ``red_max(x, s)``: the sum / max of ``x`` over every index of ``s``
  (a for-loop accumulator, or a combine over a grid axis).
- ``assemble(x, d, s)``: the tiles ``x`` of every index of ``s`` concatenated along ``d`` (a store).
- ``run_max(x, s)``: the running max inside a loop (only the rescale identity removes it).

The unary ops (``UNARY``: those of the op registry with a function symbol of their own, `ops.symbols`:
exp, silu, gelu_tanh, sqrt, rsqrt) are uninterpreted function symbols: only the rules that hold for every elementwise function move slices, stacks and unit
dims through them, and the field identities name exp and rsqrt alone, so adding an elementwise
function (tanh-approximated GELU) adds no equation that could prove a wrong design.

Indexing (the fixed-size dims of rotary's halves and gathered rows; every size below is a
concrete int, every dim counted from the right):

- ``x.slc(d, start, stop, step, n)``: ``x[start:stop:step]`` along d, where x has size n there
  (broadcast to n where x has size 1); `stop` is canonical, one past the last index taken, so equal
  slices are one term.
- ``t.gather(i, g, r)``: the rows of table t along its dim g picked by the integer tensor i of rank r
  (``t.index_select(g, i.flatten())``, i's dims in place of g): out dim ``j + g + 1`` is i's dim j.
- ``a.cat(b, d, na, nb)``: a (size na at d) then b (size nb); ``a.il(b, d, m)``: a and b (size m
  each) interleaved, a at the even indices (GPT-J's form).

Their rules (`indexing`) move slices down to the leaves (through elementwise ops, reductions along
other dims, unit dims, gathers' kept dims, concats along other dims; a factor broadcast along the
sliced dim passes through) and pull block partitions (`part`) out of them along the dims they leave
alone (an index's part is the gather's part along that index dim); a slice of a concat is the part
it picks, two adjacent slices concatenated are one. No rule moves a `part` across the sliced,
gathered or concatenated dim itself, so a tile sliced or gathered where it is partitioned proves
nothing.

Facts asserted by the translation and propagated here: ``indep(x, s)`` (x does not depend
on the index of s) and ``bcast(x, d)`` (x has size 1 at dim d, or lacks it).
"""

from __future__ import annotations

from egglog import (
    Expr,
    StringLike,
    eq,
    i64,
    i64Like,
    ne,
    relation,
    rewrite,
    rule,
    ruleset,
    seq,
    union,
)

from prism_serve.optimize.ir import ops
from prism_serve.optimize.verify import egglog_threads  # noqa: F401 - one thread, before any e-graph runs
from prism_serve.optimize.verify.field import field_identities

UNARY = ops.symbols()


def _unary_method():
    def method(self) -> T: ...

    return method


class Sym(Expr):
    """A symbolic size: a grid axis or a for-loop range."""

    def __init__(self, name: StringLike) -> None: ...


class T(Expr):
    @classmethod
    def var(cls, name: StringLike) -> T: ...

    @classmethod
    def const(cls, value: StringLike) -> T: ...

    @classmethod
    def inv_size(cls, s: Sym) -> T: ...

    def __add__(self, other: T) -> T: ...

    def __sub__(self, other: T) -> T: ...

    def __mul__(self, other: T) -> T: ...

    def __truediv__(self, other: T) -> T: ...

    # one method per unary function symbol of the op registry, named as the op
    locals().update({op: _unary_method() for op in UNARY})

    def tr(self) -> T: ...

    def mm(self, other: T) -> T: ...

    def sum(self, d: i64Like) -> T: ...

    def max(self, d: i64Like) -> T: ...

    def squeeze(self, d: i64Like) -> T: ...

    def unsq(self, d: i64Like) -> T: ...

    def part(self, d: i64Like, s: Sym) -> T: ...

    def assemble(self, d: i64Like, s: Sym) -> T: ...

    def replicate(self, s: Sym) -> T: ...

    def red_sum(self, s: Sym) -> T: ...

    def red_max(self, s: Sym) -> T: ...

    def run_max(self, s: Sym) -> T: ...

    def slc(self, d: i64Like, start: i64Like, stop: i64Like, step: i64Like, n: i64Like) -> T: ...

    def gather(self, index: T, g: i64Like, rank: i64Like) -> T: ...

    def cat(self, other: T, d: i64Like, na: i64Like, nb: i64Like) -> T: ...

    def il(self, other: T, d: i64Like, m: i64Like) -> T: ...


indep = relation("indep", T, Sym)
bcast = relation("bcast", T, i64)

MAXD = 6
DIMS = tuple(range(-1, -MAXD - 1, -1))
BATCH = DIMS[2:]
GATHER_DIMS = DIMS[:4]  # a gathered dim of a table of rank <= 4 (rotary's cache: -2) ...
MAX_INDEX_RANK = 3  # ... by an index of rank <= 3 (positions: 2); the rules name each combination
BINARY_OPS = ops.of_kind(ops.Kind.BINARY)
BINARY = tuple(ops.OPS[op].egg for op in BINARY_OPS)  # their methods


def _bin(op: str, a: T, b: T) -> T:
    return getattr(a, op)(b)


@ruleset
def facts(x: T, y: T, e: T, s: Sym, t: Sym, d: i64, d2: i64):
    """Analysis: independence of a loop / grid index, and broadcasting, through the constructors."""
    for op in BINARY:
        yield rule(eq(e).to(_bin(op, x, y)), indep(x, s), indep(y, s)).then(indep(e, s))
        yield rule(eq(e).to(_bin(op, x, y)), bcast(x, d), bcast(y, d)).then(bcast(e, d))
    for op in UNARY:
        yield rule(eq(e).to(getattr(x, op)()), indep(x, s)).then(indep(e, s))
        yield rule(eq(e).to(getattr(x, op)()), bcast(x, d)).then(bcast(e, d))
    yield rule(eq(e).to(x.mm(y)), indep(x, s), indep(y, s)).then(indep(e, s))
    yield rule(eq(e).to(x.tr()), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.sum(d)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.max(d)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.squeeze(d)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.unsq(d)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.unsq(d))).then(bcast(e, d))
    yield rule(eq(e).to(x.run_max(t)), indep(x, s), ne(s).to(t)).then(indep(e, s))
    yield rule(eq(e).to(x.sum(d))).then(bcast(e, d))
    yield rule(eq(e).to(x.max(d))).then(bcast(e, d))
    yield rule(eq(e).to(x.part(d, t)), indep(x, s), ne(s).to(t)).then(indep(e, s))
    yield rule(eq(e).to(x.red_sum(t))).then(indep(e, t))
    yield rule(eq(e).to(x.red_sum(t)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.red_max(t))).then(indep(e, t))
    yield rule(eq(e).to(x.red_max(t)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.assemble(d, t))).then(indep(e, t))
    yield rule(eq(e).to(x.assemble(d, t)), indep(x, s)).then(indep(e, s))


@ruleset
def parallel(x: T, y: T, s: Sym, t: Sym, d: i64, d2: i64):
    """Partition / replicate / combine / reduce: pull slices out, then fold the reductions."""
    for op in BINARY:
        yield rewrite(_bin(op, x.part(d, s), y.part(d, s))).to(_bin(op, x, y).part(d, s))
        yield rewrite(_bin(op, x.part(d, s), y)).to(_bin(op, x, y).part(d, s), indep(y, s), bcast(y, d))
        yield rewrite(_bin(op, y, x.part(d, s))).to(_bin(op, y, x).part(d, s), indep(y, s), bcast(y, d))
    for op in UNARY:
        yield rewrite(getattr(x.part(d, s), op)()).to(getattr(x, op)().part(d, s))
    # slices along different dims commute
    yield rewrite(x.part(d, s).part(d2, t)).to(x.part(d2, t).part(d, s), ne(d).to(d2))
    # transpose swaps the two last dims
    yield rewrite(x.part(-1, s).tr()).to(x.tr().part(-2, s))
    yield rewrite(x.part(-2, s).tr()).to(x.tr().part(-1, s))
    # a row / column slice of a matmul operand is a slice of the product
    yield rewrite(x.part(-2, s).mm(y)).to(x.mm(y).part(-2, s), indep(y, s))
    yield rewrite(x.mm(y.part(-1, s))).to(x.mm(y).part(-1, s), indep(x, s))
    # reductions along another dim than the slice's (keepdim: dims stay put)
    yield rewrite(x.part(d, s).sum(d2)).to(x.sum(d2).part(d, s), ne(d).to(d2))
    yield rewrite(x.part(d, s).max(d2)).to(x.max(d2).part(d, s), ne(d).to(d2))
    yield rewrite(x.part(d, s).red_sum(t)).to(x.red_sum(t).part(d, s), ne(s).to(t))
    yield rewrite(x.part(d, s).red_max(t)).to(x.red_max(t).part(d, s), ne(s).to(t))
    # sum splitting: the parts of a dim reduce to the whole dim
    yield rewrite(x.part(d, s).sum(d).red_sum(s)).to(x.sum(d), indep(x, s))
    yield rewrite(x.part(d, s).max(d).red_max(s)).to(x.max(d), indep(x, s))
    yield rewrite(x.part(-1, s).mm(y.part(-2, s)).red_sum(s)).to(x.mm(y), indep(x, s), indep(y, s))
    # batch dims of a matmul, and the dims a transpose leaves alone
    for b in BATCH:
        yield rewrite(x.part(b, s).mm(y.part(b, s))).to(x.mm(y).part(b, s))
        yield rewrite(x.part(b, s).mm(y)).to(x.mm(y).part(b, s), indep(y, s), bcast(y, b))
        yield rewrite(x.mm(y.part(b, s))).to(x.mm(y).part(b, s), indep(x, s), bcast(x, b))
        yield rewrite(x.part(b, s).tr()).to(x.tr().part(b, s))
    # inserting / removing a unit dim moves the slices left of it
    for e_ in DIMS:
        for d_ in DIMS:
            if d_ == e_:
                continue
            yield rewrite(x.part(d_, s).unsq(e_)).to(x.unsq(e_).part(d_ if d_ > e_ else d_ - 1, s))
            yield rewrite(x.part(d_, s).squeeze(e_)).to(x.squeeze(e_).part(d_ if d_ > e_ else d_ + 1, s))
    yield rewrite(x.unsq(d).squeeze(d)).to(x)
    for op in BINARY:
        yield rewrite(_bin(op, x.unsq(d), y.unsq(d))).to(_bin(op, x, y).unsq(d))
        yield rewrite(_bin(op, x.assemble(d, s), y.assemble(d, s))).to(_bin(op, x, y).assemble(d, s))
        yield rewrite(_bin(op, x.assemble(d, s), y)).to(_bin(op, x, y).assemble(d, s), indep(y, s), bcast(y, d))
        yield rewrite(_bin(op, y, x.assemble(d, s))).to(_bin(op, y, x).assemble(d, s), indep(y, s), bcast(y, d))
    for op in UNARY:
        yield rewrite(getattr(x.unsq(d), op)()).to(getattr(x, op)().unsq(d))
        yield rewrite(getattr(x.assemble(d, s), op)()).to(getattr(x, op)().assemble(d, s))
    yield rewrite(x.unsq(d).red_sum(s)).to(x.red_sum(s).unsq(d))
    yield rewrite(x.unsq(d).red_max(s)).to(x.red_max(s).unsq(d))
    # reducing a stacked dim is reducing over the stacking index (each tile is a unit slice)
    yield rewrite(x.assemble(d, s).sum(d)).to(x.red_sum(s), bcast(x, d))
    yield rewrite(x.assemble(d, s).max(d)).to(x.red_max(s), bcast(x, d))
    yield rewrite(x.assemble(d, s).sum(d2)).to(x.sum(d2).assemble(d, s), ne(d).to(d2))
    yield rewrite(x.assemble(d, s).max(d2)).to(x.max(d2).assemble(d, s), ne(d).to(d2))
    yield rewrite(x.assemble(d, s).part(d, s)).to(x)
    yield rewrite(x.assemble(d, s).part(d2, t)).to(x.part(d2, t).assemble(d, s), ne(d).to(d2), ne(s).to(t))
    # combine: concatenating every slice gives the tensor back; replicas of an invariant agree
    yield rewrite(x.part(d, s).assemble(d, s)).to(x)
    yield rewrite(x.replicate(s)).to(x, indep(x, s))
    # loop-invariant factors leave a sum
    yield rewrite((x * y).red_sum(s)).to(x.red_sum(s) * y, indep(y, s))


@ruleset
def index_facts(x: T, y: T, e: T, s: Sym, d: i64, d2: i64, a: i64, b: i64, st: i64, n: i64, m: i64):
    """Analysis through slices, gathers and concats: independence of an index, and broadcasting
    along the dims they keep."""
    yield rule(eq(e).to(x.slc(d, a, b, st, n)), indep(x, s)).then(indep(e, s))
    yield rule(eq(e).to(x.slc(d, a, b, st, n)), bcast(x, d2), ne(d).to(d2)).then(bcast(e, d2))
    yield rule(eq(e).to(x.gather(y, d, m)), indep(x, s), indep(y, s)).then(indep(e, s))
    for g in GATHER_DIMS:
        for r in range(1, MAX_INDEX_RANK + 1):
            for j in range(-r, 0):
                if j + g + 1 >= -MAXD:
                    yield rule(eq(e).to(x.gather(y, g, r)), bcast(y, j)).then(bcast(e, j + g + 1))
            for k in DIMS:
                if k > g:
                    yield rule(eq(e).to(x.gather(y, g, r)), bcast(x, k)).then(bcast(e, k))
    yield rule(eq(e).to(x.cat(y, d, a, b)), indep(x, s), indep(y, s)).then(indep(e, s))
    yield rule(eq(e).to(x.cat(y, d, a, b)), bcast(x, d2), bcast(y, d2), ne(d).to(d2)).then(bcast(e, d2))
    yield rule(eq(e).to(x.il(y, d, m)), indep(x, s), indep(y, s)).then(indep(e, s))
    yield rule(eq(e).to(x.il(y, d, m)), bcast(x, d2), bcast(y, d2), ne(d).to(d2)).then(bcast(e, d2))


@ruleset
def windows_down(x: T, y: T, s: Sym, d: i64, d2: i64, a: i64, b: i64, st: i64, n: i64, m: i64, na: i64, nb: i64):
    """Slices down to the leaves: through elementwise ops (a factor broadcast along d passes
    through: `indexing`), reductions (keepdim) and concats along other dims, unit dims. Run to its
    fixpoint before the field identities make the e-classes large (`schedule`), since each rewrite
    copies a product into every form of it the e-graph holds."""
    for op in BINARY:
        yield rewrite(_bin(op, x, y).slc(d, a, b, st, n)).to(_bin(op, x.slc(d, a, b, st, n), y.slc(d, a, b, st, n)))
    for op in UNARY:
        yield rewrite(getattr(x, op)().slc(d, a, b, st, n)).to(getattr(x.slc(d, a, b, st, n), op)())
    yield rewrite(x.sum(d2).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).sum(d2), ne(d).to(d2))
    yield rewrite(x.max(d2).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).max(d2), ne(d).to(d2))
    yield rewrite(x.cat(y, d2, na, nb).slc(d, a, b, st, n)).to(
        x.slc(d, a, b, st, n).cat(y.slc(d, a, b, st, n), d2, na, nb), ne(d).to(d2))
    yield rewrite(x.il(y, d2, m).slc(d, a, b, st, n)).to(
        x.slc(d, a, b, st, n).il(y.slc(d, a, b, st, n), d2, m), ne(d).to(d2))
    for e_ in DIMS:
        for d_ in DIMS:
            if d_ != e_:
                yield rewrite(x.unsq(e_).slc(d_, a, b, st, n)).to(x.slc(d_ if d_ > e_ else d_ + 1, a, b, st, n).unsq(e_))
                yield rewrite(x.squeeze(e_).slc(d_, a, b, st, n)).to(
                    x.slc(d_ if d_ > e_ else d_ - 1, a, b, st, n).squeeze(e_))


@ruleset
def indexing(x: T, y: T, e: T, s: Sym, d: i64, d2: i64, a: i64, b: i64, c: i64, c2: i64, st: i64,
             st2: i64, n: i64, m: i64, na: i64, nb: i64):
    """Partitions out of slices / gathers / concats, slices into gathers, and the identities of
    slices of concats (see the module docstring)."""
    yield rewrite(x.slc(d, a, b, st, n)).to(x, bcast(x, d))
    yield rewrite(x.slc(d, 0, n, 1, n)).to(x)
    # a slice of a slice along the same dim (both canonical: the composite's stop is canonical too),
    # where the outer one slices the inner one's extent (not a broadcast one, `slc(x) = x` above)
    yield rule(eq(e).to(x.slc(d, a, b, st, n).slc(d, c, c2, st2, m)), eq(m).to((b - a - 1) / st + 1)).then(
        union(e).with_(x.slc(d, a + st * c, a + st * (c2 - 1) + 1, st * st2, n)))
    # along other dims: partitions, stores, loop reductions
    yield rewrite(x.part(d2, s).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).part(d2, s), ne(d).to(d2))
    yield rewrite(x.assemble(d2, s).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).assemble(d2, s), ne(d).to(d2))
    yield rewrite(x.red_sum(s).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).red_sum(s))
    yield rewrite(x.red_max(s).slc(d, a, b, st, n)).to(x.slc(d, a, b, st, n).red_max(s))
    # a slice of a concat along its dim: the part it picks; adjacent slices concatenated: one slice
    yield rule(eq(e).to(x.cat(y, d, na, nb).slc(d, a, b, st, n)), b <= na).then(union(e).with_(x.slc(d, a, b, st, na)))
    yield rule(eq(e).to(x.cat(y, d, na, nb).slc(d, a, b, st, n)), a >= na).then(
        union(e).with_(y.slc(d, a - na, b - na, st, nb)))
    yield rewrite(x.slc(d, a, b, 1, n).cat(x.slc(d, b, c, 1, n), d, na, nb)).to(x.slc(d, a, c, 1, n))
    yield rewrite(x.il(y, d, m).slc(d, 0, m * 2 - 1, 2, m * 2)).to(x)
    yield rewrite(x.il(y, d, m).slc(d, 1, m * 2, 2, m * 2)).to(y)
    yield rewrite(x.slc(d, a, b, 2, n).il(x.slc(d, a + 1, b + 1, 2, n), d, m)).to(x.slc(d, a, b + 1, 1, n))
    # partitions along the other dims leave concats, and the index's dims leave a gather
    yield rewrite(x.part(d2, s).cat(y.part(d2, s), d, na, nb)).to(x.cat(y, d, na, nb).part(d2, s), ne(d).to(d2))
    yield rewrite(x.part(d2, s).il(y.part(d2, s), d, m)).to(x.il(y, d, m).part(d2, s), ne(d).to(d2))
    for g in GATHER_DIMS:
        for r in range(1, MAX_INDEX_RANK + 1):
            for j in range(-r, 0):
                if j + g + 1 >= -MAXD:
                    yield rewrite(x.gather(y.part(j, s), g, r)).to(x.gather(y, g, r).part(j + g + 1, s), indep(x, s))
                    yield rewrite(x.gather(y, g, r).slc(j + g + 1, a, b, st, n)).to(
                        x.gather(y.slc(j, a, b, st, n), g, r))
            for k in DIMS:
                if k > g:  # the table's dims after the gathered one keep their place
                    yield rewrite(x.part(k, s).gather(y, g, r)).to(x.gather(y, g, r).part(k, s), indep(y, s))
                    yield rewrite(x.gather(y, g, r).slc(k, a, b, st, n)).to(x.slc(k, a, b, st, n).gather(y, g, r))
                elif k < g and k - r + 1 >= -MAXD:  # and those before it move left by the index's rank - 1
                    yield rewrite(x.part(k, s).gather(y, g, r)).to(x.gather(y, g, r).part(k - r + 1, s), indep(y, s))


@ruleset
def arith(x: T, y: T, z: T, d: i64):
    """Field identities used by the fused designs (commutativity, associativity, distributivity,
    division, matmul linearity in a per-row scalar, exp / max identities of online softmax)."""
    yield from field_identities(x, y, z)
    yield rewrite((x + y) * z).to(x * z + y * z)
    yield rewrite(x.mm(y) * z).to((x * z).mm(y), bcast(z, -1))
    yield rewrite(x.mm(y) / z).to((x / z).mm(y), bcast(z, -1))
    yield rewrite(x.exp() * y.exp()).to((x + y).exp())
    yield rewrite(x.sum(d) * y).to((x * y).sum(d), bcast(y, d))
    yield rewrite((x - y) + (y - z)).to(x - z)


WINDOW_ROUNDS = 16  # rounds that move slices down: one per op between a slice and the leaves, at most


def schedule(iterations: int = 12):
    """Bounded: slices moved down first (`windows_down`, before the field identities run), then
    analysis to a fixpoint between each round of rewriting."""
    return seq(_analysis(), windows_down + indexing) * WINDOW_ROUNDS + rounds(iterations)


def rounds(iterations: int):
    """Rounds of the main rewriting alone (to go on after `schedule`)."""
    return seq(_analysis(), parallel + arith + indexing) * iterations


def _analysis():
    return (facts + index_facts).saturate()
