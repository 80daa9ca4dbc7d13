"""The field identities both e-graph algebras rewrite by: the proof's (`algebra.arith`, over `T`)
and the abstract expressions' (`generate/abstract.py`'s ``_algebra``, over `Abs`). An egglog-python
ruleset is a function over typed sorts, and the two sorts differ, so these are written once over
any sort with the arithmetic operators and ``sqrt`` / ``rsqrt``, and each ruleset yields them for
its own variables (``yield from field_identities(x, y, z)``)."""

from __future__ import annotations

from egglog import rewrite


def field_identities(x, y, z):
    """Commutativity of + and *, associativity of * (both ways) and of +, a quotient times a
    factor as the product over the divisor, and x * rsqrt(y) = x / sqrt(y)."""
    yield rewrite(x + y).to(y + x)
    yield rewrite(x * y).to(y * x)
    yield rewrite((x * y) * z).to(x * (y * z))
    yield rewrite(x * (y * z)).to((x * y) * z)
    yield rewrite((x + y) + z).to(x + (y + z))
    yield rewrite((x / y) * z).to((x * z) / y)
    yield rewrite(x * y.rsqrt()).to(x / y.sqrt())
