"""A Program's abstract expressions with its slices moved down to its inputs, and the slices,
gathers and concats a design may build.

The generator's designs slice loads only (a windowed load; the sGraph renders nothing else), so the
target's terms are written the same way: a slice of an elementwise op is the op of the slices (a
factor broadcast along the sliced dim passes through), of a reduction along another dim the
reduction of the slice, of a gather along the table's kept dims the gather of the sliced table (or
of the sliced index, along its dims), of a concat the part it picks; two slices of one dim compose.
These are identities of the proof's algebra (`verify/algebra.py`'s ``indexing``), so the forms
agree with the Program's value. A slice of an input is then a variable of its own
(`abstract.sliced`). A slice that does not move down (of a matmul, of a reduced dim, across a
concat's parts) stays a variable named after its node, which no design reaches: the generator
finds nothing there, and the proof and the numeric check stay the judges of what it does find.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.optimize.generate.abstract import BINARY, REDUCE, UNARY, Term, sliced
from prism_serve.optimize.ir.ops import OPS, Op

Window = tuple[int, int, int]  # start, canonical stop, step


def canonical(start: int, stop: int, step: int) -> Window:
    count = -(-(stop - start) // step)
    return start, start + step * (count - 1) + 1, step


@dataclass(frozen=True)
class Indexing:
    """The slices, gathers and concats of a Program, by the labels they read, for the generator:
    ``slices[(label, window)]`` is the label the sliced dim gets; ``concats[(labels of a, labels
    of b, interleave)]`` the joined dim (from the left) and its label; ``gathers`` the labels of
    the tables' gathered dims."""

    slices: dict[tuple[str, Window], str | None]
    concats: dict[tuple[tuple, tuple, bool], tuple[int, str | None]]
    gathers: frozenset[str | None]


NO_INDEXING = Indexing({}, {}, frozenset())


def indexing(flat, labels) -> Indexing:
    slices, concats, gathers = {}, {}, set()
    for n in flat.nodes:
        if n.op not in (Op.SLICE, Op.CONCAT, Op.GATHER):
            continue
        d = n.attr("dim") % len(flat.types[n.inputs[0]].shape)
        ins = [labels.dims[s] for s in n.inputs]
        if n.op == Op.SLICE:
            key = (ins[0][d], canonical(n.attr("start"), n.attr("stop"), n.attr("step")))
            slices.setdefault(key, labels.dims[n.name][d])
        elif n.op == Op.CONCAT:
            concats.setdefault((ins[0], ins[1], n.attr("interleave")), (d, labels.dims[n.name][d]))
        else:
            gathers.add(ins[0][d])
    return Indexing(slices, concats, frozenset(gathers))


def slice_var(name: str, dim: int, window: Window) -> str:
    """The variable of a slice of variable `name` (an input, or a slice of one) along `dim`
    (counted from the right): one window per dim, composed where `name` has one along `dim`
    already, in the order of their dims (as `abstract.sliced` names them)."""
    base, _, rest = name.partition("[")
    windows = {}
    for seg in ("[" + rest).split("[")[1:] if rest else ():
        d, a, b, st = map(int, seg.rstrip("]").split(":"))
        windows[d] = (a, b, st)
    a, b, st = window
    if dim in windows:  # the new window picks from the old one's
        oa, ob, ost = windows[dim]
        a, b, st = oa + ost * a, oa + ost * (b - 1) + 1, ost * st
    windows[dim] = (a, b, st)
    for d in sorted(windows):
        base = sliced(base, d, *windows[d])
    return base


def indexed_labels(op: str, attrs: dict, ins: list[tuple], indexing: Indexing) -> tuple | None:
    """The labels of a slice's, gather's or concat's result as the Program labels it, or None where
    the Program has no such op over these labels."""
    x = ins[0]
    d = attrs["dim"] % len(x)
    if op == Op.SLICE:
        label = indexing.slices.get((x[d], canonical(attrs["start"], attrs["stop"], attrs["step"])), False)
        return None if label is False else x[:d] + (label,) + x[d + 1:]
    if op == Op.GATHER:
        return x[:d] + ins[1] + x[d + 1:]
    joined = indexing.concats.get((x, ins[1], attrs["interleave"]))
    return None if joined is None or joined[0] != d else x[:d] + (joined[1],) + x[d + 1:]


def gather_spec(dim: int) -> str:
    """A gather's spec in its abstract term: the gathered dim of the table, counted from the right."""
    return str(dim)


def concat_spec(dim: int, interleave: bool) -> str:
    return f"{dim}{'i' if interleave else ''}"


def program_terms(flat, labels) -> dict[str, Term]:
    """The abstract expression of every node of an expanded Program, slices moved down."""
    return _normalised(flat, labels)[0]


def sliced_labels(flat, labels) -> dict[str, frozenset[str]]:
    """The labels of every sliced input variable the Program's terms use."""
    return _normalised(flat, labels)[1]


def term_nodes(flat, labels) -> tuple[tuple[Term, tuple], ...]:
    """Every term the Program's values are built of, with its labels, in the order a design builds
    them (each after its operands; without slices, one per node in the Program's order): where a
    slice moves down, the sliced loads and the ops over them come where the slice was."""
    return tuple(_normalised(flat, labels)[2])


def _normalised(flat, labels) -> tuple[dict[str, Term], dict[str, frozenset[str]], list]:
    terms: dict[tuple[str, tuple], Term] = {}
    sliced_labels: dict[str, frozenset[str]] = {}
    order: list[tuple[Term, tuple]] = []
    types = flat.types
    by_name = flat.by_name

    def rank(name: str) -> int:
        return len(types[name].shape)

    def term(name: str, windows: tuple) -> Term:
        """`name`'s term under `windows`: sorted (dim from the right, window, label) triples."""
        key = (name, windows)
        if key not in terms:
            terms[key] = _term(name, windows)
            own = list(labels.dims[name])
            for d, _, lb in windows:
                own[d] = lb
            order.append((terms[key], tuple(own)))
        return terms[key]

    def keep(name: str, windows: tuple) -> tuple:
        """The windows that apply to operand `name` (broadcast along the others)."""
        shape = types[name].shape
        return tuple(w for w in windows if -w[0] <= len(shape) and shape[w[0]] != 1)

    def opaque(name: str, windows: tuple) -> Term:
        return ("var", name + "".join(f"[{d}:{a}:{b}:{s}]" for d, (a, b, s), _ in windows))

    def _term(name: str, windows: tuple) -> Term:
        n = by_name[name]
        e = lambda s, w=windows: term(s, keep(s, w))  # noqa: E731
        if n.op == "input":
            if not windows:
                return ("var", name)
            var = name
            for d, (a, b, s), _ in windows:
                if (a, b, s) != (0, types[name].shape[d], 1):  # a window over the whole dim is no slice
                    var = sliced(var, d, a, b, s)
            dims = dict((d, lb) for d, _, lb in windows)
            own = labels.dims[name]
            sliced_labels[var] = frozenset(dims.get(i - len(own), lb) for i, lb in enumerate(own)) - {None}
            return ("var", var)
        if n.op == "const":
            return ("const", name)
        if n.op == Op.SLICE:
            d = n.attr("dim") % rank(n.inputs[0]) - rank(n.inputs[0])
            a, b, s = canonical(n.attr("start"), n.attr("stop"), n.attr("step"))
            lb = labels.dims[name][d]
            outer = next((w for w in windows if w[0] == d), None)
            if outer is not None:  # compose: the outer window picks from this one's
                (oa, ob, os_), lb = outer[1], outer[2]
                a, b, s = a + s * oa, a + s * (ob - 1) + 1, s * os_
            rest = tuple(w for w in windows if w[0] != d)
            return term(n.inputs[0], tuple(sorted(rest + ((d, (a, b, s), lb),))))
        if OPS[n.op].expands_to:  # square: x * x
            return (OPS[n.op].expands_to, e(n.inputs[0]), e(n.inputs[0]))
        if n.op in BINARY:
            return (n.op, e(n.inputs[0]), e(n.inputs[1]))
        if n.op in UNARY:
            return (n.op, e(n.inputs[0]))
        if n.op in REDUCE:
            d = n.attr("dim") % rank(n.inputs[0]) - rank(n.inputs[0])
            if windows and (not n.attr("keepdim") or any(w[0] == d for w in windows)):
                return opaque(name, windows)
            return (n.op, labels.reduced[name][0], e(n.inputs[0]))
        if n.op == Op.MATMUL:
            if windows:
                return opaque(name, windows)
            return (Op.SUM, labels.reduced[name][0], (Op.MUL, e(n.inputs[0]), e(n.inputs[1])))
        if n.op == Op.GATHER:
            table, index = n.inputs
            g = n.attr("dim") % rank(table) - rank(table)
            ri = rank(index)
            on_table, on_index = [], []
            for d, w, lb in windows:
                if d > g:
                    on_table.append((d, w, lb))
                elif d >= g - ri + 1:
                    on_index.append((d - g - 1, w, lb))
                else:
                    on_table.append((d + ri - 1, w, lb))
            return (Op.GATHER, gather_spec(g), term(table, tuple(sorted(on_table))),
                    term(index, tuple(sorted(on_index))))
        if n.op == Op.CONCAT:
            a, b = n.inputs
            d = n.attr("dim") % rank(a) - rank(a)
            own = next((w for w in windows if w[0] == d), None)
            if own is None:
                return (Op.CONCAT, concat_spec(d, n.attr("interleave")), e(a), e(b))
            rest = tuple(w for w in windows if w[0] != d)
            (start, stop, step), lb = own[1], own[2]
            na = types[a].shape[d]
            if n.attr("interleave"):
                picked = {(0, 2 * na - 1, 2): a, (1, 2 * na, 2): b}.get((start, stop, step))
                return term(picked, keep(picked, rest)) if picked else opaque(name, windows)
            if stop <= na:
                return term(a, tuple(sorted(keep(a, rest) + ((d, (start, stop, step), lb),))))
            if start >= na:
                return term(b, tuple(sorted(keep(b, rest) + ((d, (start - na, stop - na, step), lb),))))
            return opaque(name, windows)
        raise AssertionError(n.op)

    out = {n.name: term(n.name, ()) for n in flat.nodes}
    return out, sliced_labels, order
