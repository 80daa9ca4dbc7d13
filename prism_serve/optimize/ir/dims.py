"""Dimension expressions: the small grammar in which stored sGraphs write tensor dims.

A dim read from a registry or an export is untrusted text, so it is parsed here by hand into
sympy objects (never `sympify`, which evaluates Python):

    expr  := term (("+" | "-") term)*
    term  := atom (("*" | "//") atom)*
    atom  := INT | NAME | "-" atom | "(" expr ")" | "cdiv" "(" expr "," expr ")"

INT is a decimal literal of at most `MAX_VALUE` (so that whatever `render` writes, including a
constant folded from smaller literals, reads back); NAME an identifier the caller allows (the
sGraph's own symbols and ``num_tokens``); ``a // b`` is floor division, ``cdiv(a, b)`` ceiling
division. The text is at most `MAX_LENGTH` characters, nests at most `MAX_DEPTH` deep, and
every number of the result is at most `MAX_VALUE`: anything else is refused with the reason.
`render` writes an expression back in the same grammar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

import sympy

from prism_serve.errors import SGraphError

MAX_LENGTH = 200
MAX_DEPTH = 16
MAX_INT = 2**31 - 1  # a Program's fixed dims (schema.py)
MAX_VALUE = 2**62
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>\*\*|//|[-+*(),]))")


class _Parser:
    def __init__(self, text: str, symbol: Callable[[str], sympy.Symbol], allowed: Collection[str] | None):
        self.text, self.symbol, self.allowed = text, symbol, allowed
        self.tokens = self._tokens()
        self.i = 0

    def fail(self, msg: str) -> SGraphError:
        return SGraphError(f"dim {self.text!r:.80}: {msg}")

    def _tokens(self) -> list[tuple[str, str, int]]:
        out, pos, text = [], 0, self.text
        while text[pos:].strip():
            m = _TOKEN.match(text, pos)
            if not m:
                char = text[pos:].lstrip()[0]
                raise self.fail(f"character {char!r} is not part of the dim grammar "
                                f"(integers, symbols, + - * // cdiv and parentheses)")
            kind = m.lastgroup
            if m.group("op") == "**":
                raise self.fail("powers (**) are not part of the dim grammar")
            out.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        return out

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str) -> bool:
        tok = self.peek()
        if tok and tok[0] == "op" and tok[1] == value:
            self.i += 1
            return True
        return False

    def parse(self) -> sympy.Expr:
        if not self.tokens:
            raise self.fail("empty")
        expr = self.expr(0)
        tok = self.peek()
        if tok:
            raise self.fail(f"unexpected {tok[1]!r} at position {tok[2]}: expected an operator or the end")
        return expr

    def expr(self, depth: int) -> sympy.Expr:
        value = self.term(depth)
        while True:
            if self.take("+"):
                value = value + self.term(depth)
            elif self.take("-"):
                value = value - self.term(depth)
            else:
                return value

    def term(self, depth: int) -> sympy.Expr:
        value = self.atom(depth)
        while True:
            if self.take("*"):
                value = value * self.atom(depth)
            elif self.take("//"):
                divisor = self.atom(depth)
                if divisor == 0:
                    raise self.fail("division by zero")
                value = sympy.floor(value / divisor)
            else:
                return value

    def atom(self, depth: int) -> sympy.Expr:
        if depth >= MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH}")
        tok = self.peek()
        if tok is None:
            raise self.fail("ends where a number, symbol or '(' was expected")
        kind, value, pos = tok
        self.i += 1
        if kind == "int":
            if len(value) > len(str(MAX_VALUE)) or int(value) > MAX_VALUE:
                raise self.fail(f"integer {value[:20]}{'...' if len(value) > 20 else ''} exceeds 2**62")
            return sympy.Integer(int(value))
        if kind == "name" and value == "cdiv":
            if not self.take("("):
                raise self.fail("cdiv needs '(' a ',' b ')'")
            a = self.expr(depth + 1)
            if not self.take(","):
                raise self.fail("cdiv needs '(' a ',' b ')'")
            b = self.expr(depth + 1)
            if not self.take(")"):
                raise self.fail("cdiv needs '(' a ',' b ')'")
            if b == 0:
                raise self.fail("division by zero")
            return sympy.ceiling(a / b)
        if kind == "name":
            if not NAME.fullmatch(value):
                raise self.fail(f"symbol name {value[:20]!r}... is too long")
            if self.allowed is not None and value not in self.allowed:
                raise self.fail(f"symbol {value!r} is not one of this sGraph's symbols {sorted(self.allowed)}")
            return self.symbol(value)
        if value == "-":
            return -self.atom(depth + 1)
        if value == "(":
            inner = self.expr(depth + 1)
            if not self.take(")"):
                raise self.fail(f"'(' at position {pos} is not closed")
            return inner
        raise self.fail(f"unexpected {value!r} at position {pos}: expected a number, symbol or '('")


def parse_dim(text: str, symbol: Callable[[str], sympy.Symbol],
              allowed: Collection[str] | None = None) -> sympy.Expr:
    """The sympy expression of a dim written in the grammar above; `symbol(name)` makes each
    symbol, `allowed` (when given) lists the names it may use. Raises SGraphError with the reason."""
    if not isinstance(text, str):
        raise SGraphError(f"dim {text!r:.80} must be a string or an int")
    if len(text) > MAX_LENGTH:
        raise SGraphError(f"dim {text[:40]!r}... is longer than {MAX_LENGTH} characters")
    expr = _Parser(text, symbol, allowed).parse()
    check_value(expr, text)
    return expr


def check_value(expr: sympy.Expr, text: str = "") -> None:
    """Every number in `expr` must be at most MAX_VALUE in magnitude (numerator and denominator)."""
    for atom in expr.atoms(sympy.Number):
        p, q = sympy.fraction(atom)
        if not (atom.is_Rational and abs(int(p)) <= MAX_VALUE and abs(int(q)) <= MAX_VALUE):
            raise SGraphError(f"dim {text or expr!s:.80}: number {atom!s:.40} is out of range (|x| <= 2**62)")


def render(expr: sympy.Expr | int) -> str:
    """`expr` written in the dim grammar (what `parse_dim` reads back to the same expression)."""
    if isinstance(expr, int):
        expr = sympy.Integer(expr)
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if isinstance(expr, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        if isinstance(expr, sympy.floor):
            return f"{_factor(num)} // {_factor(den)}"
        return f"cdiv({render(num)}, {render(den)})"
    if expr.is_Add:
        terms = expr.as_ordered_terms()
        out = render(terms[0])
        for t in terms[1:]:
            coeff, rest = t.as_coeff_Mul()
            out += f" - {render(-t)}" if coeff.is_negative else f" + {render(t)}"
        return out
    if expr.is_Mul:
        coeff, factors = expr.as_coeff_mul()
        if not coeff.is_Integer:
            raise SGraphError(f"dim {expr} has a coefficient {coeff}; it cannot be stored")
        sign = "-" if coeff < 0 else ""
        return sign + " * ".join(([] if abs(coeff) == 1 else [str(abs(int(coeff)))]) + [_factor(f) for f in factors])
    if expr.is_Pow and expr.exp.is_Integer and 1 < int(expr.exp) <= 8:
        return " * ".join([_factor(expr.base)] * int(expr.exp))
    raise SGraphError(f"dim {expr} is outside the storable dim grammar")


def _factor(expr: sympy.Expr) -> str:
    text = render(expr)
    return text if expr.is_Atom or isinstance(expr, (sympy.ceiling,)) else f"({text})"
