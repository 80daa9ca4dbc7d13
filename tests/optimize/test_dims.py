"""The dim grammar: what it reads means what sympy says it means, what it writes it reads back,
and anything else is refused quickly with an SGraphError, never evaluated."""

from __future__ import annotations

import time

import pytest
import sympy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.dims import MAX_DEPTH, parse_dim, render
from prism_serve.optimize.ir.sgraph import sym

NAMES = ("S", "F", "BT", "num_tokens")


def _tree(depth: int = 0):
    """Random dim expressions as (text, independent meaning as a function of symbol values)."""
    leaves = st.one_of(st.integers(1, 5000).map(lambda n: (str(n), lambda v, n=n: n)),
                       st.sampled_from(NAMES).map(lambda s: (s, lambda v, s=s: v[s])))
    if depth >= 4:
        return leaves

    def combine(args):
        (a, fa), op, (b, fb) = args
        if op == "cdiv":
            return f"cdiv({a}, {b})", lambda v: -(-fa(v) // fb(v))
        fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
              "//": lambda x, y: x // y}[op]
        return f"({a}) {op} ({b})", lambda v: fn(fa(v), fb(v))

    return st.one_of(leaves, st.tuples(_tree(depth + 1), st.sampled_from(["+", "-", "*", "//", "cdiv"]),
                                       _tree(depth + 1)).map(combine))


@settings(max_examples=40, deadline=None, database=None)
@given(tree=_tree(), values=st.fixed_dictionaries({n: st.integers(1, 300) for n in NAMES}))
def test_parsed_dims_mean_what_python_integer_arithmetic_says(tree, values):
    text, meaning = tree
    try:
        want = meaning(values)
        expr = parse_dim(text, sym)
    except ZeroDivisionError:
        assume(False)
    except SGraphError as exc:  # a divisor that is 0 for every value, or a product past 2**62
        assume("division by zero" not in str(exc) and "out of range" not in str(exc))
        raise
    got = expr.subs({sym(n): v for n, v in values.items()})
    assert got == want
    # render writes what reads back as the same value; sympy may regroup a negated product
    # (-(F + 1)*(S + 1) reads back as (-F - 1)*(S + 1)) or reduce a floor's fraction (4 // (2*(1 + S))
    # is written 2 // (S + 1)), so equality is algebraic, not structural: each floor's and ceiling's
    # fraction in lowest terms, then expanded
    assert (_lowest_terms(parse_dim(render(expr), sym)) - _lowest_terms(expr)).expand() == 0


def _lowest_terms(expr: sympy.Expr) -> sympy.Expr:
    """`expr` with the fraction inside every floor and ceiling cancelled (the same value wherever defined)."""
    return expr.replace(lambda t: isinstance(t, (sympy.floor, sympy.ceiling)), lambda t: t.func(sympy.cancel(t.args[0])))


@settings(max_examples=80, deadline=None, database=None)
@given(text=st.text(alphabet="0123456789 ()+-*/.,_abcdefxyzSF^%[]'\"\\", max_size=60))
def test_any_text_is_parsed_or_refused_quickly(text):
    start = time.perf_counter()
    try:
        expr = parse_dim(text, sym)
    except SGraphError:
        pass
    else:
        assert isinstance(expr, sympy.Expr)
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("text, message", [
    ("9**9**9**9", r"powers \(\*\*\) are not part"), ("2**2**26", "powers"), ("x.func.mro", "character '.'"),
    ("1 2", "unexpected '2'"), ("__import__('os')", "character \"'\""), ("S", "not one of this sGraph's symbols"),
    ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested deeper"), ("4 // 0", "division by zero"),
    ("99999999999999999999", "exceeds"), ("1" * 201, "longer than 200"), ("", "empty"), ("cdiv(1)", "cdiv needs"),
])
def test_refusals_say_why(text, message):
    with pytest.raises(SGraphError, match=message):
        parse_dim(text, sym, allowed={"F", "num_tokens"})
