"""The op registry: one definition per IR op, which every stage reads.

An `OpDef` says what an op is everywhere it matters: its arity and attributes (`program.py`
checks them, the typed loader `schema.py` parses them), its kind (which type rule and label rule
apply), its torch reference (`reference.py`), its Triton and torch renderings (`codegen/`), its
function symbol in the egglog algebras (`verify/algebra.py`, `generate/abstract.py`) and how the
abstract expressions see it (`generate/context.py`, `generate/block.py`), and its cost class
(`instantiate/cost.py`). Modules name an op through `Op`, never by a string of its own.

Adding an elementwise op is one `OpDef` in `DEFINITIONS` (tests/optimize/test_ops.py adds one to
a copy of the registry and follows it through every stage). An op the algebras should treat as an
uninterpreted function symbol gets ``egg`` (its method name on the egglog sorts) and a ``tag`` of
its own: no rewrite rule names it, so it can prove nothing wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping


class Op:
    """Every IR op's name, as the plain string a `Node.op` holds (constants, not an Enum: the
    generator compares ops millions of times, and a plain string hashes and prints as itself)."""

    INPUT = "input"
    CONST = "const"
    MATMUL = "matmul"
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    EXP = "exp"
    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    SQUARE = "square"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    RMS_NORM = "rms_norm"
    GATHER = "gather"
    SLICE = "slice"
    CONCAT = "concat"


class Kind(Enum):
    """Which type rule, label rule and rendering family an op follows."""

    LEAF = "leaf"  # input, const
    MATMUL = "matmul"
    BINARY = "binary"  # elementwise, broadcasting
    UNARY = "unary"  # elementwise
    REDUCE = "reduce"  # along attribute dim, keepdim
    COMPOSITE = "composite"  # expanded into primitives before any stage but the library kernel
    GATHER = "gather"  # rows of a float table picked along a fixed dim by an integer index tensor
    SLICE = "slice"  # a strided window along a fixed dim
    CONCAT = "concat"  # two tensors joined (or interleaved) along a fixed dim


# The tag the abstract expressions give sqrt and rsqrt alike (x * rsqrt(y) = x / sqrt(y)).
ROOT = "root"
# 1 + tanh(u) = 2 sigmoid(2u), so tanh-approximated GELU with u = sqrt(2/pi) (x + 0.044715 x^3) is
# x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)): no tanh (which Triton's core language lacks) and no
# cancellation of 1 + tanh(u) near -1
GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class OpDef:
    """One IR op. Templates take the operands' expressions as ``{0}``, ``{1}``."""

    name: str  # an `Op`
    kind: Kind
    arity: int | tuple[int, ...]
    attrs: Mapping[str, type] = field(default_factory=dict)  # required, with their Python types
    defaults: Mapping[str, Any] = field(default_factory=dict)  # optional, filled in by `node`
    torch: Callable | None = None  # the fp32 reference: (operands, attrs dict) -> tensor
    triton: str | None = None  # a block's Triton expression (elementwise ops)
    torch_source: str | None = None  # a library kernel's torch expression in generated source
    egg: str | None = None  # the method of the egglog sorts that stands for it (elementwise ops)
    expands_to: Op | None = None  # an elementwise op the algebras see as this binary op of x with x
    tag: str | None = None  # its abstract-expression tag: no rewrite rule moves a factor across it
    created_by_rules: bool = False  # whether a rewrite rule may create the op from others
    commutative: bool = False


def _torch():
    import torch  # the reference needs torch; the registry itself must not

    return torch


def _reduce(fn: str) -> Callable:
    return lambda args, a: getattr(_torch(), fn)(args[0], dim=a["dim"], keepdim=a["keepdim"])


def _gather(args, a):
    table, index = args
    dim = a["dim"] % table.dim()
    out_shape = table.shape[:dim] + index.shape + table.shape[dim + 1:]
    return table.index_select(dim, index.reshape(-1)).reshape(out_shape)


def _slice(args, a):
    x = args[0]
    return x[(slice(None),) * (a["dim"] % x.dim()) + (slice(a["start"], a["stop"], a["step"]),)]


def _concat(args, a):
    dim = a["dim"] % args[0].dim()
    if a["interleave"]:  # out[2i] = a[i], out[2i + 1] = b[i] along dim
        return _torch().stack(args, dim + 1).flatten(dim, dim + 1)
    return _torch().cat(args, dim)


_REDUCE_ATTRS = {"dim": int, "keepdim": bool}
DEFINITIONS: tuple[OpDef, ...] = (
    OpDef(Op.INPUT, Kind.LEAF, 0, {"shape": tuple, "dtype": str}),
    OpDef(Op.CONST, Kind.LEAF, 0, {"value": float}),
    OpDef(Op.MATMUL, Kind.MATMUL, 2, {"transpose_b": bool}, {"transpose_b": False},
          torch=lambda x, a: _torch().matmul(x[0], x[1].transpose(-1, -2) if a["transpose_b"] else x[1])),
    OpDef(Op.ADD, Kind.BINARY, 2, torch=lambda x, a: x[0] + x[1], triton="{0} + {1}", torch_source="{0} + {1}",
          egg="__add__", tag="add", created_by_rules=True, commutative=True),
    OpDef(Op.SUB, Kind.BINARY, 2, torch=lambda x, a: x[0] - x[1], triton="{0} - {1}", torch_source="{0} - {1}",
          egg="__sub__", tag="sub"),
    OpDef(Op.MUL, Kind.BINARY, 2, torch=lambda x, a: x[0] * x[1], triton="{0} * {1}", torch_source="{0} * {1}",
          egg="__mul__", created_by_rules=True, commutative=True),
    OpDef(Op.DIV, Kind.BINARY, 2, torch=lambda x, a: x[0] / x[1], triton="{0} / {1}", torch_source="{0} / {1}",
          egg="__truediv__"),
    OpDef(Op.EXP, Kind.UNARY, 1, torch=lambda x, a: _torch().exp(x[0]), triton="tl.exp({0})",
          torch_source="torch.exp({0})", egg="exp", tag="exp"),
    OpDef(Op.SILU, Kind.UNARY, 1, torch=lambda x, a: _torch().nn.functional.silu(x[0]),
          triton="{0} * tl.sigmoid({0})", torch_source="torch.nn.functional.silu({0})", egg="silu", tag="silu"),
    # torch's own tanh-approximated GELU (Gemma's gelu_pytorch_tanh)
    OpDef(Op.GELU_TANH, Kind.UNARY, 1, torch=lambda x, a: _torch().nn.functional.gelu(x[0], approximate="tanh"),
          triton="{0} * tl.sigmoid(" + repr(GELU_TANH_SCALE) + " * ({0} + 0.044715 * {0} * {0} * {0}))",
          torch_source="torch.nn.functional.gelu({0}, approximate='tanh')", egg="gelu_tanh", tag="gelu_tanh"),
    OpDef(Op.SQUARE, Kind.UNARY, 1, torch=lambda x, a: x[0] * x[0], triton="{0} * {0}",
          torch_source="{0} * {0}", expands_to=Op.MUL),
    OpDef(Op.SQRT, Kind.UNARY, 1, torch=lambda x, a: _torch().sqrt(x[0]), triton="tl.sqrt({0})",
          torch_source="torch.sqrt({0})", egg="sqrt", tag=ROOT),
    OpDef(Op.RSQRT, Kind.UNARY, 1, torch=lambda x, a: _torch().rsqrt(x[0]), triton="tl.rsqrt({0})",
          torch_source="torch.rsqrt({0})", egg="rsqrt", tag=ROOT),
    OpDef(Op.SUM, Kind.REDUCE, 1, _REDUCE_ATTRS, {"keepdim": False}, torch=_reduce("sum"), torch_source="torch.sum"),
    OpDef(Op.MEAN, Kind.REDUCE, 1, _REDUCE_ATTRS, {"keepdim": False}, torch=_reduce("mean"),
          torch_source="torch.mean"),
    OpDef(Op.MAX, Kind.REDUCE, 1, _REDUCE_ATTRS, {"keepdim": False}, torch=_reduce("amax"),
          torch_source="torch.amax", tag="max"),
    OpDef(Op.RMS_NORM, Kind.COMPOSITE, (1, 2), {"eps": float}),
    # gather(table, index): out shape table.shape[:dim] + index.shape + table.shape[dim + 1:]
    OpDef(Op.GATHER, Kind.GATHER, 2, {"dim": int}, torch=_gather),
    # slice(x)[..., i, ...] = x[..., start + i * step, ...] along dim, for i < ceil((stop - start) / step)
    OpDef(Op.SLICE, Kind.SLICE, 1, {"dim": int, "start": int, "stop": int, "step": int}, {"step": 1},
          torch=_slice),
    OpDef(Op.CONCAT, Kind.CONCAT, 2, {"dim": int, "interleave": bool}, {"interleave": False}, torch=_concat),
)
OPS: Mapping[str, OpDef] = {d.name: d for d in DEFINITIONS}


def of_kind(*kinds: Kind) -> tuple[str, ...]:
    """The names of the ops of `kinds`, in registry order."""
    return tuple(name for name, d in OPS.items() if d.kind in kinds)


def symbols() -> tuple[str, ...]:
    """The elementwise unary ops the algebras hold as function symbols of their own, in registry order."""
    return tuple(name for name, d in OPS.items() if d.kind is Kind.UNARY and d.egg)
