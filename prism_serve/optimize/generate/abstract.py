"""Abstract expressions: what a tensor computes, up to the algebra, for pruning the generator.

Every tensor the generator creates (a kernel tensor, or a tile of a block graph) gets a term over
the Program's inputs, with index labels (`labels.py`) naming the dims that reductions run over:

    ("var", name) | ("const", name) | (op, a[, b]) for op in add sub mul div exp silu gelu_tanh sqrt rsqrt
    | ("sum" | "mean" | "max", label, a) | (gather, spec, table, index) | (concat, spec, a, b)

Slices sit at the leaves: a Program's slices are moved down to its inputs (`context.py`, by the
identities the proof's algebra holds), and a design slices only its loads, so a slice of an input
is a variable of its own, named by `sliced` (``q[-1:0:64:1]``); a gather and a concat are function
symbols that no rule crosses (tagged as themselves: `leaves`, `op_tags`).

A matmul contracting label K is ``("sum", K, ("mul", a, b))``; ``square(x)`` is ``x * x``. The
abstraction forgets which slice of a tensor a tile holds (the proof and the numeric check decide
that), so it is an over-approximation: a tensor whose term is no subexpression of any equivalent
form of the target cannot be part of a correct design and is pruned at once.

"Subexpression of an equivalent form" is decided by egglog: the target's terms are saturated
once per search under the rules below (commutativity and associativity of + and *, moving a
factor independent of a label in and out of a sum / mean over it, moving a divisor out of a
product, rsqrt as a division by sqrt) and every subterm of every form is marked ``within``.
Two cheap necessary conditions come first (the symbols a term uses, and its leaves under the
ops that no rule crosses: `leaves`, `fits`); then a query adds one term, runs the same bounded
schedule, and reads the mark. Verdicts are cached by the term's form up to commutativity and
associativity of + and * (`ac_form`), which the rules equate anyway (so the first form asked
decides for all; the bounded schedule could in principle tell them apart). Queries go to the
e-graph as egglog text through the bindings (the typed Python front end costs several times the
e-graph's own work per query).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cached_property

from egglog import EGraph, Expr, String, StringLike, eq, relation, rewrite, rule, ruleset, seq
from egglog.bindings import EggSmolError

from prism_serve.optimize.ir.ops import OPS, ROOT, Kind, Op, of_kind, symbols
from prism_serve.optimize.verify import egglog_threads  # noqa: F401 - one thread, before any e-graph runs
from prism_serve.optimize.verify.field import field_identities

Term = tuple
BINARY = of_kind(Kind.BINARY)
UNARY = symbols()  # the unary ops with a function symbol of their own (square is expanded to x * x)
REDUCE = of_kind(Kind.REDUCE)
QUERY_ITERATIONS = 2
TARGET_ITERATIONS = 12


def _unary_method():
    def method(self) -> Abs: ...

    return method


class AbsLabel(Expr):
    """An index label (a dim class of the Program)."""

    def __init__(self, name: StringLike) -> None: ...


class Abs(Expr):
    @classmethod
    def var(cls, name: StringLike) -> Abs: ...

    @classmethod
    def const(cls, name: StringLike) -> Abs: ...

    def __add__(self, other: Abs) -> Abs: ...

    def __sub__(self, other: Abs) -> Abs: ...

    def __mul__(self, other: Abs) -> Abs: ...

    def __truediv__(self, other: Abs) -> Abs: ...

    # one method per unary function symbol of the op registry, named as the op
    locals().update({op: _unary_method() for op in UNARY})

    def rsum(self, lb: AbsLabel) -> Abs: ...

    def rmean(self, lb: AbsLabel) -> Abs: ...

    def rmax(self, lb: AbsLabel) -> Abs: ...

    def gather(self, index: Abs, spec: StringLike) -> Abs: ...

    def cat(self, other: Abs, spec: StringLike) -> Abs: ...


indep = relation("abs_indep", Abs, AbsLabel)
within = relation("abs_within", Abs)
_OPS = {op: getattr(Abs, OPS[op].egg) for op in BINARY}
_RED = {Op.SUM: "rsum", Op.MEAN: "rmean", Op.MAX: "rmax"}
INDEXED = (Op.GATHER, Op.CONCAT)  # heads (head, spec, a, b): function symbols with a spec string
_INDEXED_METHODS = {Op.GATHER: "gather", Op.CONCAT: "cat"}


def sliced(name: str, dim: int, start: int, stop: int, step: int) -> str:
    """The variable that stands for a slice of input `name` (`dim` counted from the right, `stop`
    canonical: one past the last index taken), so that equal slices are one variable."""
    count = -(-(stop - start) // step)
    return f"{name}[{dim}:{start}:{start + step * (count - 1) + 1}:{step}]"


def sliced_base(name: str) -> str:
    """The input a (possibly sliced) variable reads."""
    return name.split("[", 1)[0]


def operands(t: Term) -> tuple:
    """The operand terms of `t`."""
    head = t[0]
    if head in ("var", "const"):
        return ()
    if head in REDUCE:
        return (t[2],)
    return t[2:] if head in INDEXED else t[1:]


@ruleset
def _facts(x: Abs, y: Abs, e: Abs, lb: AbsLabel, other: AbsLabel, spec: String):
    for op in _OPS.values():
        yield rule(eq(e).to(op(x, y)), indep(x, lb), indep(y, lb)).then(indep(e, lb))
    for op in UNARY:
        yield rule(eq(e).to(getattr(x, op)()), indep(x, lb)).then(indep(e, lb))
    yield rule(eq(e).to(x.gather(y, spec)), indep(x, lb), indep(y, lb)).then(indep(e, lb))
    yield rule(eq(e).to(x.cat(y, spec)), indep(x, lb), indep(y, lb)).then(indep(e, lb))
    for red in _RED.values():
        yield rule(eq(e).to(getattr(x, red)(lb))).then(indep(e, lb))
        yield rule(eq(e).to(getattr(x, red)(other)), indep(x, lb)).then(indep(e, lb))


@ruleset
def _algebra(x: Abs, y: Abs, z: Abs, lb: AbsLabel):
    yield from field_identities(x, y, z)
    yield rewrite((x * z) / y).to((x / y) * z)  # the converses, which the proof's algebra does without
    yield rewrite(x / y.sqrt()).to(x * y.rsqrt())
    for red in ("rsum", "rmean"):
        yield rewrite(getattr(x * y, red)(lb)).to(getattr(x, red)(lb) * y, indep(y, lb))
        yield rewrite(getattr(x, red)(lb) * y).to(getattr(x * y, red)(lb), indep(y, lb))
    yield rewrite((x / y).rsum(lb)).to(x.rsum(lb) / y, indep(y, lb))
    yield rewrite(x.rsum(lb) / y).to((x / y).rsum(lb), indep(y, lb))


@ruleset
def _subterms(e: Abs, x: Abs, y: Abs, lb: AbsLabel, spec: String):
    for op in _OPS.values():
        yield rule(within(e), eq(e).to(op(x, y))).then(within(x), within(y))
    yield rule(within(e), eq(e).to(x.gather(y, spec))).then(within(x), within(y))
    yield rule(within(e), eq(e).to(x.cat(y, spec))).then(within(x), within(y))
    for op in UNARY:
        yield rule(within(e), eq(e).to(getattr(x, op)())).then(within(x))
    for red in _RED.values():
        yield rule(within(e), eq(e).to(getattr(x, red)(lb))).then(within(x))


def _mean_rules(labels: list[str]):
    """mean over a label = sum over it times the constant ``inv.<label>`` (1 / its size)."""
    @ruleset
    def means(y: Abs):
        for lb in labels:
            yield rewrite(y.rmean(AbsLabel(lb))).to(y.rsum(AbsLabel(lb)) * Abs.const(f"inv.{lb}"))
            yield rewrite(y.rsum(AbsLabel(lb)) * Abs.const(f"inv.{lb}")).to(y.rmean(AbsLabel(lb)))
    return means


def _schedule(iterations: int, extra):
    return seq(_facts.saturate(), _algebra + extra) * iterations + _facts.saturate() + _subterms.saturate()


def to_egg(t: Term) -> Abs:
    head = t[0]
    if head == "var":
        return Abs.var(t[1])
    if head == "const":
        return Abs.const(t[1])
    if head in BINARY:
        return _OPS[head](to_egg(t[1]), to_egg(t[2]))
    if head in UNARY:
        return getattr(to_egg(t[1]), head)()
    if head in REDUCE:
        return getattr(to_egg(t[2]), _RED[head])(AbsLabel(t[1]))
    if head in INDEXED:
        return getattr(to_egg(t[2]), _INDEXED_METHODS[head])(to_egg(t[3]), t[1])
    raise ValueError(f"no abstract form for {head!r}")


def _symbols(t: Term) -> frozenset:
    head = t[0]
    if head in ("var", "const"):
        return frozenset([t])
    if head == Op.MEAN:  # the rules equate a mean with a sum times the constant inv.<label>
        return _symbols(t[2]) | {(Op.SUM, t[1]), ("const", f"inv.{t[1]}")}
    if head in REDUCE:
        return _symbols(t[2]) | {(head, t[1])}
    if head in INDEXED:
        return frozenset({(head, t[1])}).union(*(_symbols(a) for a in t[2:]))
    own = {head} if _TAGGED.get(head) == head and head in BINARY + UNARY else set()
    return frozenset(own).union(*(_symbols(a) for a in t[1:]))


def op_tags(t: Term) -> frozenset:
    """The kinds of op in `t` that every equivalent form has: exp, silu, gelu_tanh, add, sub, a root
    (sqrt or rsqrt), and a sum (a mean is a sum times ``inv.<label>``) or a max over each label. No rule
    of `_algebra` or of the mean rules creates or removes one (they reorder products and move
    factors across sums and divisions), so a design must make every kind its output's term has."""
    head = t[0]
    if head in ("var", "const"):
        return frozenset()
    if head in REDUCE:
        return frozenset({(Op.MAX if head == Op.MAX else Op.SUM, t[1])}) | op_tags(t[2])
    own = {(_TAGGED[head],)} if head in _TAGGED else set()
    return frozenset(own).union(*(op_tags(a) for a in operands(t)))


# sqrt and rsqrt: ROOT; exp, silu, ..., add, sub, max, gather, concat: own
_TAGGED = {op: d.tag for op, d in OPS.items() if d.tag} | {op: op for op in INDEXED}


_LEAVES: dict[Term, Counter] = {}


def leaves(t: Term, tags: frozenset = frozenset()) -> Counter:
    """`_leaves` of `t` (memoised at the top, where no tags are above it: every query asks it of
    whole candidate terms, which the generator builds again and again)."""
    if tags:
        return _leaves(t, tags)
    out = _LEAVES.get(t)
    if out is None:
        if len(_LEAVES) >= _AC_MAX:
            _LEAVES.clear()
        out = _LEAVES[t] = _leaves(t, tags)
    return out


def _leaves(t: Term, tags: frozenset) -> Counter:
    """The multiset of `t`'s variables and constants (but the ``inv.<label>`` of a mean), each with
    the set of tags of the ops above it that no rule moves a factor across: sqrt and rsqrt (one
    tag, ``root``, since x * rsqrt(y) = x / sqrt(y)), exp, silu, gelu_tanh, add, sub, max. Every rule keeps
    this multiset (+ and * reassociate within their tag, factors move across products, sums,
    means and divisions, which carry none), so it is the same for every term of an e-class."""
    head = t[0]
    if head in ("var", "const"):
        return Counter() if head == "const" and t[1].startswith("inv.") else Counter({(t, tags): 1})
    tag = _TAGGED.get(head)
    inner = tags | {tag} if tag else tags
    out: Counter = Counter()
    for a in operands(t):
        out += _leaves(a, inner)
    return out


def fits(t: Counter, target: Counter) -> bool:
    """A necessary condition for a term with leaves `t` to be a subterm of a term with leaves
    `target`: a subterm's leaves map one to one into the whole's, to the same leaf under at least
    the same tags; so for every leaf and tag set S, the leaves under tags >= S are no more."""
    for (leaf, tags) in t:
        need = sum(n for (lf, tg), n in t.items() if lf == leaf and tags <= tg)
        have = sum(n for (lf, tg), n in target.items() if lf == leaf and tags <= tg)
        if need > have:
            return False
    return True


def _frozen(c: Counter) -> frozenset:
    return frozenset(c.items())


def _operand_signatures(t: Term) -> tuple:
    """What the operands of `t`'s head must be, up to the algebra, for `t` to be a node of some
    form of a target that holds the same signature. No rule creates sub, exp, silu, gelu_tanh, a
    root or a max: such a node of a saturated form is congruent to one of the target as written,
    so its operands are equal to that one's and have its leaves (which every rule keeps). A
    division is created only by moving a divisor the target already has (or from x * rsqrt(y), as
    x / sqrt(y)): its divisor is equal to one of those. Heads the rules create or rebuild
    (add, mul, sum, mean) sign nothing."""
    head = t[0]
    if head in INDEXED:
        return ((head, t[1]) + tuple(_frozen(leaves(a)) for a in t[2:]),)
    if _TAGGED.get(head) == head and head in BINARY + UNARY and not OPS[head].created_by_rules:  # sub, exp, silu, ...
        return ((head,) + tuple(_frozen(leaves(a)) for a in t[1:]),)
    if _TAGGED.get(head) == ROOT:
        return ((ROOT, _frozen(leaves(t[1]))), ("divisor", _frozen(leaves((Op.SQRT, t[1])))))
    if head == Op.MAX:
        return ((Op.MAX, t[1], _frozen(leaves(t[2]))),)
    if head == Op.DIV:
        return (("divisor", _frozen(leaves(t[2]))),)
    return ()


def term_parts(t: Term):
    """`t` and every term inside it."""
    yield t
    for a in operands(t):
        yield from term_parts(a)


_AC: dict[Term, Term] = {}
_AC_MAX = 1 << 20  # terms; the memo is emptied when full (pure: what is dropped is recomputed alike)


def ac_form(t: Term) -> Term:
    """`t` with every chain of + and of * flattened, its operands sorted and rebuilt left-deep:
    one representative per class of terms equal up to commutativity and associativity."""
    out = _AC.get(t)
    if out is None:
        head = t[0]
        if head in ("var", "const"):
            out = t
        elif head in (Op.ADD, Op.MUL):
            ops: list[Term] = []
            stack = [t]
            while stack:
                u = stack.pop()
                if u[0] == head:
                    stack += [u[2], u[1]]
                else:
                    ops.append(ac_form(u))
            ops.sort(key=repr)
            out = ops[0]
            for o in ops[1:]:
                out = (head, out, o)
        elif head in REDUCE or head in INDEXED:
            out = (head, t[1]) + tuple(ac_form(a) for a in t[2:])
        else:
            out = (head,) + tuple(ac_form(a) for a in t[1:])
        if len(_AC) >= _AC_MAX:
            _AC.clear()
        _AC[t] = out
    return out


class Oracle:
    """The target's terms saturated once; `within(term)` and `equals(term, output)` queries, cached."""

    def __init__(self, targets: dict[str, Term], var_labels: dict[str, frozenset[str]], consts: tuple[str, ...],
                 nodes: tuple[tuple[Term, tuple], ...] = ()):
        self.targets = targets
        self._positions: dict[tuple[Term, tuple], int] = {}  # (AC form, labels) -> its first node's index
        for i, (t, labels) in enumerate(nodes):
            self._positions.setdefault((ac_form(t), labels), i)
        labels = sorted(set().union(*var_labels.values())) if var_labels else []
        self.egraph = EGraph()
        facts = [indep(Abs.var(v), AbsLabel(lb)) for v, have in var_labels.items() for lb in labels if lb not in have]
        facts += [indep(Abs.const(c), AbsLabel(lb)) for c in consts for lb in labels]
        self.handles = {o: self.egraph.let(f"target_{i}", to_egg(t)) for i, (o, t) in enumerate(targets.items())}
        if facts:
            self.egraph.register(*facts)
        self.egraph.register(*(within(h) for h in self.handles.values()))
        means = [c[len("inv."):] for c in consts if c.startswith("inv.")]
        self.rules = _mean_rules(means)
        self.egraph.run(_schedule(TARGET_ITERATIONS, self.rules))
        self._text = _TextForm(self.egraph)
        self._run = self.egraph._egraph.run_program
        self._push, = self.egraph._egraph.parse_program("(push)")
        self._pop, = self.egraph._egraph.parse_program("(pop)")
        self._query_schedule = self.egraph._state.run_schedule_to_egg(_schedule(QUERY_ITERATIONS, self.rules).schedule)
        self._check_within, = self.egraph._egraph.parse_program(f"(check ({self._text.within} $q))")
        self._check_equals = {o: self.egraph._egraph.parse_program(f"(check (= $q $target_{i}))")[0]
                              for i, o in enumerate(targets)}
        self._leaves = [leaves(t) for t in targets.values()]
        self._operands = frozenset(sig for t in targets.values() for s in term_parts(t)
                                   for sig in _operand_signatures(s))
        self._literal = frozenset(ac_form(s) for t in targets.values() for s in term_parts(t))
        self._reduced = frozenset(ac_form(s[2]) for t in targets.values() for s in term_parts(t) if s[0] in REDUCE)
        self.enabled = True  # False: every term passes (to check that the rule is sound)
        self._within: dict[Term, bool] = {}
        self._equals: dict[tuple[Term, str], bool] = {}
        self.queries = 0

    @cached_property
    def _symbols(self) -> frozenset:
        return frozenset().union(*(_symbols(t) for t in self.targets.values()))

    @cached_property
    def sliced_inputs(self) -> frozenset[str]:
        """The inputs the targets read through slices only or as well: a design loads them whole
        and slices the loaded tile (a windowed load), so such a whole input passes `within`."""
        return frozenset(sliced_base(s[1]) for t in self.targets.values() for s in term_parts(t)
                         if s[0] == "var" and sliced_base(s[1]) != s[1])

    def within(self, t: Term) -> bool:
        if not self.enabled or t[0] == "var" and t[1] in self.sliced_inputs:
            return True
        key = ac_form(t)  # the rules hold + and * commutative and associative: one query per form
        if key in self._within:
            return self._within[key]
        ok = key in self._literal or self._may_be_within(t) and self._query(t, self._check_within)
        self._within[key] = ok
        return ok

    def literal(self, t: Term, reduced: bool = False, labels: tuple | None = None) -> bool:
        """Whether `t` is a subterm of a target as the Program writes it (up to + and * order), and
        with `reduced` one that the Program reduces (sums, means or maxes) directly; with `labels`,
        the result of a node of the Program laid out as the Program lays it out (`position`). The
        generator tries such ops first, so the Program's own fused form comes early."""
        key = ac_form(t)
        if key not in (self._reduced if reduced else self._literal):
            return False
        return labels is None or (key, labels) in self._positions

    @cached_property
    def reduced_labels(self) -> frozenset[str]:
        """The labels the targets reduce over: no rule creates a reduction over another label."""
        return frozenset(s[1] for t in self.targets.values() for s in term_parts(t) if s[0] in REDUCE)

    def position(self, t: Term, labels: tuple) -> int | None:
        """The index, in the Program's order, of the first node that computes `t` (up to + and *
        order) laid out with these index labels, or None: neither a transposed product nor the
        elementwise product inside a matmul is a node of the Program."""
        return self._positions.get((ac_form(t), labels))

    def _may_be_within(self, t: Term) -> bool:
        """Necessary conditions: no rule creates a variable, a constant, exp, silu, gelu_tanh, add,
        sub or a reduction over a label the target's forms lack, a subterm's leaves fit the whole's,
        and an op that no rule creates has operands the target gives it (`_operand_signatures`)."""
        return _symbols(t) <= self._symbols and any(fits(leaves(t), lv) for lv in self._leaves) and \
            all(sig in self._operands for sig in _operand_signatures(t))

    def prefetch(self, terms) -> None:
        """Decide `within` for many terms with one e-graph run (the per-run cost dominates a query).
        Exact, not an approximation: rules only add facts, so a term that a run with the others
        beside it does not mark is not marked alone either (cached False); a term it does mark is
        confirmed by its own query (the others might have helped), and those are few, since the
        rule prunes most terms. So every verdict is the one `within` gives alone."""
        if not self.enabled:
            return
        batch: dict[Term, Term] = {}
        for t in terms:
            key = ac_form(t)
            if key in self._within or key in batch:
                continue
            if key in self._literal:  # a subterm of a target as written is marked at saturation
                self._within[key] = True
            elif not self._may_be_within(t):
                self._within[key] = False
            else:
                batch[key] = t
        if len(batch) < 2:
            return
        marked = self._query_batch(list(batch.values()))
        for (key, t), ok in zip(batch.items(), marked):
            self._within[key] = ok and self._query(t, self._check_within)

    def equals(self, t: Term, output: str) -> bool:
        key = (t, output)
        if key not in self._equals:  # equal terms have the same symbols and leaves (no rule changes them)
            self._equals[key] = t == self.targets[output] or (
                _symbols(t) == _symbols(self.targets[output])
                and leaves(t) == leaves(self.targets[output]) and self._query(t, self._check_equals[output]))
        return self._equals[key]

    def _query(self, t: Term, check) -> bool:
        """Add `t` (as egglog text, through the bindings: the typed Python front end costs several
        times the e-graph's own work per query), run the query schedule, run `check`, undo."""
        self.queries += 1
        self._run(self._push)
        try:
            let, = self.egraph._egraph.parse_program(f"(let $q {self._text(t)})")
            self._run(let, self._query_schedule)
            try:
                self._run(check)
                return True
            except EggSmolError:
                return False
        finally:
            self._run(self._pop)

    def _query_batch(self, terms: list[Term]) -> list[bool]:
        """Whether each term is marked `within` after one run of the query schedule with all of them."""
        self.queries += 1
        parse = self.egraph._egraph.parse_program
        self._run(self._push)
        try:
            self._run(*parse("".join(f"(let $q{i} {self._text(t)})" for i, t in enumerate(terms))),
                      self._query_schedule)
            out = []
            for i in range(len(terms)):
                check, = parse(f"(check ({self._text.within} $q{i}))")
                try:
                    self._run(check)
                    out.append(True)
                except EggSmolError:
                    out.append(False)
            return out
        finally:
            self._run(self._pop)


class _TextForm:
    """Abstract terms as egglog text, with the names the Python front end gave the constructors."""

    def __init__(self, egraph: EGraph):
        name = lambda fn: egraph._callable_to_egg(fn)[1]  # noqa: E731
        self.ops = {op: name(getattr(Abs, attr)) for op, attr in
                    {**{op: OPS[op].egg for op in BINARY + UNARY}, "var": "var", "const": "const", **_RED,
                     **_INDEXED_METHODS}.items()}
        self.label = name(AbsLabel)
        self.within = name(within)
        self._cache: dict[Term, str] = {}

    def __call__(self, t: Term) -> str:
        text = self._cache.get(t)
        if text is None:
            head = t[0]
            if head in ("var", "const"):
                text = f"({self.ops[head]} {json.dumps(t[1])})"
            elif head in REDUCE:
                text = f"({self.ops[head]} {self(t[2])} ({self.label} {json.dumps(t[1])}))"
            elif head in INDEXED:
                text = f"({self.ops[head]} {self(t[2])} {self(t[3])} {json.dumps(t[1])})"
            elif head in BINARY or head in UNARY:
                text = f"({self.ops[head]} {' '.join(self(a) for a in t[1:])})"
            else:
                raise ValueError(f"no abstract form for {head!r}")
            self._cache[t] = text
        return text
