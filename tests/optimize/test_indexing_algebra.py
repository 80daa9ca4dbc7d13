"""The proof's algebra for slices, gathers and concats, on hand-written terms: each identity the
rotary designs need holds, and the near misses of each (a slice of a partitioned dim, a part of the
gathered dim, a slice past the part it picks, halves or cos / sin swapped) do not."""

from __future__ import annotations

import pytest
from egglog import EGraph, eq
from egglog.bindings import EggSmolError

from prism_serve.optimize.verify import algebra as A
from prism_serve.optimize.verify.algebra import Sym, T

S, H = Sym("S"), Sym("H")
X, Y, W, R = T.var("x"), T.var("y"), T.var("w"), T.var("r")
CACHE, POS = T.var("cache"), T.var("positions")


def _equal(a: T, b: T, facts=()) -> bool:
    egraph = EGraph()
    ha, hb = egraph.let("a", a), egraph.let("b", b)
    if facts:
        egraph.register(*facts)
    egraph.run(A.schedule(12))
    try:
        egraph.check(eq(ha).to(hb))
    except EggSmolError:
        return False
    return True


def _indep(*terms: T, syms=(S, H)) -> list:
    return [A.indep(t, s) for t in terms for s in syms]


def _half(x: T, which: int, n: int = 8) -> T:
    return x.slc(-1, which * n // 2, (which + 1) * n // 2, 1, n)


def test_slice_of_concat_picks_the_part():
    cat = X.cat(Y, -1, 4, 6)
    assert _equal(cat.slc(-1, 0, 4, 1, 10), X)
    assert _equal(cat.slc(-1, 4, 10, 1, 10), Y)
    assert _equal(cat.slc(-1, 5, 8, 1, 10), Y.slc(-1, 1, 4, 1, 6))
    assert not _equal(cat.slc(-1, 0, 4, 1, 10), Y)
    assert not _equal(cat.slc(-1, 3, 7, 1, 10), Y.slc(-1, 0, 4, 1, 6))  # straddles both parts


def test_adjacent_slices_concatenated_are_the_whole():
    assert _equal(_half(X, 0).cat(_half(X, 1), -1, 4, 4), X)
    assert not _equal(_half(X, 1).cat(_half(X, 0), -1, 4, 4), X)  # halves swapped
    assert not _equal(X.slc(-1, 0, 4, 1, 8).cat(X.slc(-1, 5, 8, 1, 8), -1, 4, 3), X.slc(-1, 0, 7, 1, 8))


def test_interleaved_concat_and_strided_slices():
    even, odd = X.slc(-1, 0, 7, 2, 8), X.slc(-1, 1, 8, 2, 8)
    assert _equal(even.il(odd, -1, 4), X)
    assert not _equal(odd.il(even, -1, 4), X)
    il = X.il(Y, -1, 4)
    assert _equal(il.slc(-1, 0, 7, 2, 8), X) and _equal(il.slc(-1, 1, 8, 2, 8), Y)
    assert not _equal(il.slc(-1, 1, 8, 2, 8), X)
    assert not _equal(X.cat(Y, -1, 4, 4).slc(-1, 0, 7, 2, 8), X)  # a plain concat is not interleaved


def test_slice_of_slice_composes():
    assert _equal(X.slc(-1, 2, 10, 1, 12).slc(-1, 1, 5, 1, 8), X.slc(-1, 3, 7, 1, 12))
    assert _equal(X.slc(-1, 0, 12, 1, 16).slc(-1, 1, 12, 2, 12), X.slc(-1, 1, 12, 2, 16))
    assert not _equal(X.slc(-1, 2, 10, 1, 12).slc(-1, 1, 5, 1, 8), X.slc(-1, 1, 5, 1, 12))


def test_slice_distributes_and_a_broadcast_factor_passes_through():
    # qk-norm: slice(x * r * w) = slice(x) * r * slice(w), r of size 1 along the sliced dim
    facts = [A.bcast(R, -1)]
    assert _equal(((X * R) * W).slc(-1, 0, 4, 1, 8), (X.slc(-1, 0, 4, 1, 8) * R) * W.slc(-1, 0, 4, 1, 8), facts)
    assert _equal(X.exp().slc(-1, 0, 4, 1, 8), X.slc(-1, 0, 4, 1, 8).exp())
    assert not _equal(((X * R) * W).slc(-1, 0, 4, 1, 8), (X.slc(-1, 0, 4, 1, 8) * R) * W)  # w is not broadcast
    assert not _equal((X * R).slc(-1, 0, 4, 1, 8), X.slc(-1, 0, 4, 1, 8) * R)  # nor is r, without the fact
    # a reduction along another dim commutes with the slice; along the sliced dim it does not
    assert _equal(X.sum(-2).slc(-1, 0, 4, 1, 8), X.slc(-1, 0, 4, 1, 8).sum(-2))
    assert not _equal(X.sum(-1).slc(-1, 0, 1, 1, 1), X.slc(-1, 0, 4, 1, 8).sum(-1))


def test_slice_commutes_with_partitions_of_other_dims_only():
    assert _equal(X.part(-2, S).slc(-1, 0, 4, 1, 8), X.slc(-1, 0, 4, 1, 8).part(-2, S))
    assert not _equal(X.part(-1, S).slc(-1, 0, 4, 1, 8), X.slc(-1, 0, 4, 1, 8).part(-1, S))
    # a store of tiles sliced along another dim
    assert _equal(X.part(-2, S).slc(-1, 0, 4, 1, 8).assemble(-2, S), X.slc(-1, 0, 4, 1, 8))


def test_part_of_a_gather_along_the_index_dims():
    # cache (P, R) gathered by positions (T, 1) along dim 0: out (T, 1, R)
    rows = CACHE.gather(POS.part(-2, S), -2, 2)
    assert _equal(rows, CACHE.gather(POS, -2, 2).part(-3, S), _indep(CACHE))
    assert not _equal(rows, CACHE.gather(POS, -2, 2).part(-2, S), _indep(CACHE))  # the index's unit dim
    assert not _equal(rows, CACHE.gather(POS, -2, 2).part(-3, S))  # without knowing the table is shared
    # a partitioned table along its kept dim; never along the gathered dim
    assert _equal(CACHE.part(-1, S).gather(POS, -2, 2), CACHE.gather(POS, -2, 2).part(-1, S), _indep(POS))
    assert not _equal(CACHE.part(-2, S).gather(POS, -2, 2), CACHE.gather(POS, -2, 2).part(-3, S), _indep(POS))
    # cos: the first half of the gathered rows is the gather of the first half of the table
    assert _equal(CACHE.gather(POS, -2, 2).slc(-1, 0, 4, 1, 8), CACHE.slc(-1, 0, 4, 1, 8).gather(POS, -2, 2))
    assert not _equal(CACHE.gather(POS, -2, 2).slc(-1, 0, 4, 1, 8), CACHE.slc(-1, 4, 8, 1, 8).gather(POS, -2, 2))
    assert not _equal(CACHE.gather(POS, -2, 2), CACHE.gather(POS, -1, 2))  # the wrong dim


def _rotary(q: T, cache: T, pos: T, *, swap_halves=False, swap_cos_sin=False) -> T:
    """neox rotary of q (T, H, 8) as the Program writes it (whole tensors)."""
    cs = cache.gather(pos, -2, 2)
    cos, sin = _half(cs, 0), _half(cs, 1)
    if swap_cos_sin:
        cos, sin = sin, cos
    x1, x2 = _half(q, 0), _half(q, 1)
    if swap_halves:
        x1, x2 = x2, x1
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, -1, 4, 4)


def _rotary_design(**mutant) -> T:
    """The oracle's block: grid (token block S, head block H); cos / sin gathered once per token
    block (shared by every head block), q's halves as windowed loads, one store per part."""
    q = T.var("q").part(-3, S).part(-2, H)
    pos = POS.part(-2, S)
    tile = _rotary(q, CACHE, pos, **mutant)
    return tile.assemble(-2, H).assemble(-3, S)


def _rotary_facts() -> list:
    cs_tile = CACHE.gather(POS.part(-2, S), -2, 2)
    return _indep(CACHE) + [A.indep(POS.part(-2, S), H), A.indep(cs_tile, H),
                            A.bcast(cs_tile, -2), A.bcast(POS, -1)]


def test_rotary_block_design_is_proven():
    assert _equal(_rotary_design(), _rotary(T.var("q"), CACHE, POS), _rotary_facts())


@pytest.mark.parametrize("mutant", ["swap_halves", "swap_cos_sin"])
def test_rotary_mutants_are_not_proven(mutant):
    assert not _equal(_rotary_design(**{mutant: True}), _rotary(T.var("q"), CACHE, POS), _rotary_facts())
