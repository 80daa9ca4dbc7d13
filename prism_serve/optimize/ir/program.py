"""The kernel-level IR: a tensor program of immutable, typed nodes.

A `Program` is a topologically ordered tuple of `Node`s plus the names of its
outputs. Input nodes declare shape and dtype; a dim may be the symbol
``num_tokens`` (written as that string), bound only when the program runs.
Every other node's shape and dtype are inferred, so a malformed program fails
at construction with an error naming the node.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.ops import OPS as OP_DEFS
from prism_serve.optimize.ir.ops import Kind, Op, of_kind

NUM_TOKENS = "num_tokens"
DTYPES = ("float32", "float16", "bfloat16")  # of tensors that computations read and write
# of integer inputs (positions, slot mappings): only ever the index operand of a gather
INDEX_DTYPES = ("int32", "int64")
IR_VERSION = 1

Dim = int | str  # an int, or NUM_TOKENS
Shape = tuple[Dim, ...]

ELEMENTWISE_BINARY = of_kind(Kind.BINARY)
ELEMENTWISE_UNARY = of_kind(Kind.UNARY)
REDUCTIONS = of_kind(Kind.REDUCE)
INDIRECTION = of_kind(Kind.GATHER, Kind.SLICE, Kind.CONCAT)
OPS = tuple(OP_DEFS)
ARITY = {name: d.arity for name, d in OP_DEFS.items()}
ATTRS = {name: dict(d.attrs) for name, d in OP_DEFS.items() if d.attrs}  # required attributes, with their types
DEFAULTS = {name: dict(d.defaults) for name, d in OP_DEFS.items() if d.defaults}
# A block kernel's matmul may carry ("precision", TF32): its operands stay float32 and the tensor
# cores round them to TF32 (10-bit mantissa like float16, float32's exponent range), where without
# it they are cast to the Program's half dtype. Only sGraphs carry it, never a Program.
TF32 = "tf32"


def is_tf32(attrs: tuple[tuple[str, Any], ...]) -> bool:
    """Whether a matmul's (or block op's) attributes put it on TF32 operands."""
    return dict(attrs).get("precision") == TF32


def code_spelling(name: str) -> str:
    """How generated code spells an IR name: each non-word character as "_" (two names that spell
    alike would be one variable there)."""
    return re.sub(r"\W", "_", name, flags=re.ASCII)


@dataclass(frozen=True)
class Node:
    """One operation. `inputs` name earlier nodes; `attrs` is a sorted tuple of (key, value)."""

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str) -> Any:
        return dict(self.attrs)[key]


def node(name: str, op: str, *inputs: str, **attrs: Any) -> Node:
    """Build a node with normalised attributes (shapes as tuples, floats as floats)."""
    norm = {}
    for key, value in (DEFAULTS.get(op, {}) | attrs).items():
        if key == "shape":
            value = tuple(value)
        elif key in ("eps", "value"):
            value = float(value)
        norm[key] = value
    return Node(name, op, tuple(inputs), tuple(sorted(norm.items())))


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str


def _broadcast(a: Shape, b: Shape, where: str) -> Shape:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ProgramError(f"node '{where}': shapes {a} and {b} do not broadcast")
    return tuple(reversed(out))


def _fixed_dim(n: Node, shape: Shape, what: str) -> int:
    """`n`'s attribute dim, normalised, checked to be within `shape`'s rank and a fixed size."""
    dim = n.attr("dim")
    if not -len(shape) <= dim < len(shape):
        raise ProgramError(f"node '{n.name}': {n.op} dim {dim} out of range for {what} shape {shape}")
    dim %= len(shape)
    if shape[dim] == NUM_TOKENS:
        raise ProgramError(f"node '{n.name}': {n.op} along dim {dim} of {what} shape {shape}, "
                           f"which is {NUM_TOKENS}; it must be a fixed size")
    return dim


def _check_index_operands(n: Node, srcs: list[TensorType]) -> None:
    """Integer tensors are a gather's index and nothing else; a gather's index is one."""
    for i, s in enumerate(srcs):
        is_index = n.op == Op.GATHER and i == 1
        if is_index and s.dtype not in INDEX_DTYPES:
            raise ProgramError(f"node '{n.name}': gather index '{n.inputs[i]}' is {s.dtype}, "
                               f"not an integer tensor ({' or '.join(INDEX_DTYPES)})")
        if not is_index and s.dtype in INDEX_DTYPES:
            raise ProgramError(f"node '{n.name}': input '{n.inputs[i]}' is an integer tensor ({s.dtype}), "
                               f"which only a gather's index may be")


def _indirection_type(n: Node, srcs: list[TensorType]) -> TensorType:
    """The type rules of gather, slice and concat (fixed dims only: no op changes num_tokens)."""
    if n.op == Op.GATHER:
        table, index = srcs
        dim = _fixed_dim(n, table.shape, "table")
        return TensorType(table.shape[:dim] + index.shape + table.shape[dim + 1:], table.dtype)
    x = srcs[0]
    dim = _fixed_dim(n, x.shape, "input")
    if n.op == Op.SLICE:
        start, stop, step, size = n.attr("start"), n.attr("stop"), n.attr("step"), x.shape[dim]
        if not (0 <= start < stop <= size and step >= 1):
            raise ProgramError(f"node '{n.name}': slice [{start}:{stop}:{step}] of dim {dim} (size {size}) "
                               f"needs 0 <= start < stop <= {size} and step >= 1")
        return TensorType(x.shape[:dim] + (-(-(stop - start) // step),) + x.shape[dim + 1:], x.dtype)
    a, b = srcs
    if len(a.shape) != len(b.shape) or any(p != q for i, (p, q) in enumerate(zip(a.shape, b.shape)) if i != dim):
        raise ProgramError(f"node '{n.name}': concat of shapes {a.shape} and {b.shape} along dim {dim}: "
                           f"they must be equal but at that dim")
    if n.attr("interleave") and a.shape[dim] != b.shape[dim]:
        raise ProgramError(f"node '{n.name}': interleaved concat of shapes {a.shape} and {b.shape} needs "
                           f"equal sizes at dim {dim}")
    if b.shape[dim] == NUM_TOKENS:
        raise ProgramError(f"node '{n.name}': concat along dim {dim} of shape {b.shape}, which is {NUM_TOKENS}; "
                           f"it must be a fixed size")
    dtype = a.dtype if a.dtype == b.dtype else "float32"
    return TensorType(a.shape[:dim] + (a.shape[dim] + b.shape[dim],) + a.shape[dim + 1:], dtype)


def infer_type(n: Node, srcs: list[TensorType]) -> TensorType:
    if n.op == "input":
        shape, dtype = n.attr("shape"), n.attr("dtype")
        if dtype not in DTYPES + INDEX_DTYPES:
            raise ProgramError(f"node '{n.name}': dtype {dtype!r} is not one of {DTYPES + INDEX_DTYPES}")
        for d in shape:
            if not (d == NUM_TOKENS or (isinstance(d, int) and not isinstance(d, bool) and d > 0)):
                raise ProgramError(f"node '{n.name}': dim {d!r} is neither a positive int nor {NUM_TOKENS!r}")
        return TensorType(shape, dtype)
    if n.op == "const":
        return TensorType((), "const")
    _check_index_operands(n, srcs)
    if n.op in INDIRECTION:
        return _indirection_type(n, srcs)
    # mixed precisions promote to float32; `const` nodes take their partner's dtype
    dtypes = [s.dtype for s in srcs if s.dtype != "const"] or ["float32"]
    dtype = dtypes[0] if all(d == dtypes[0] for d in dtypes) else "float32"
    if n.op in ELEMENTWISE_BINARY:
        return TensorType(_broadcast(srcs[0].shape, srcs[1].shape, n.name), dtype)
    if n.op in ELEMENTWISE_UNARY:
        return TensorType(srcs[0].shape, dtype)
    if n.op in REDUCTIONS:
        shape, dim = srcs[0].shape, n.attr("dim")
        if not -len(shape) <= dim < len(shape):
            raise ProgramError(f"node '{n.name}': reduction dim {dim} out of range for shape {shape}")
        dim %= len(shape)
        kept = shape[:dim] + ((1,) if n.attr("keepdim") else ()) + shape[dim + 1:]
        return TensorType(kept, dtype)
    if n.op == Op.MATMUL:
        a, b = srcs[0].shape, srcs[1].shape
        if len(a) < 2 or len(b) < 2:
            raise ProgramError(f"node '{n.name}': matmul needs operands of rank >= 2, got {a} and {b}")
        bk, bn = (b[-1], b[-2]) if n.attr("transpose_b") else (b[-2], b[-1])
        if a[-1] != bk:
            raise ProgramError(f"node '{n.name}': matmul inner dims differ ({a} @ {b}"
                               f"{'^T' if n.attr('transpose_b') else ''})")
        batch = _broadcast(a[:-2], b[:-2], n.name)
        return TensorType(batch + (a[-2], bn), dtype)
    if n.op == Op.RMS_NORM:
        shape = srcs[0].shape
        if len(srcs) == 2 and srcs[1].shape != shape[-1:]:
            raise ProgramError(f"node '{n.name}': rms_norm weight shape {srcs[1].shape} != {shape[-1:]}")
        return TensorType(shape, dtype)
    raise AssertionError(n.op)


def _check_node(n: Node) -> None:
    if n.op not in OPS:
        raise ProgramError(f"node '{n.name}': unsupported op {n.op!r} (supported: {', '.join(OPS)})")
    arity = ARITY[n.op]
    allowed = arity if isinstance(arity, tuple) else (arity,)
    if len(n.inputs) not in allowed:
        raise ProgramError(f"node '{n.name}': op {n.op} takes {' or '.join(map(str, allowed))} inputs, "
                           f"got {len(n.inputs)}")
    attrs = dict(n.attrs)
    for key, typ in ATTRS.get(n.op, {}).items():
        if key not in attrs:
            raise ProgramError(f"node '{n.name}': op {n.op} needs attribute {key!r}")
        ok = isinstance(attrs[key], typ) and not (typ is int and isinstance(attrs[key], bool))
        if not ok:
            raise ProgramError(f"node '{n.name}': attribute {key!r} must be {typ.__name__}, got {attrs[key]!r}")
    extra = set(attrs) - set(ATTRS.get(n.op, {}))
    if extra:
        raise ProgramError(f"node '{n.name}': unknown attributes {sorted(extra)} for op {n.op}")


@dataclass(frozen=True)
class Program:
    """A tensor program: nodes in topological order and the names of its outputs.

    The program's signature is the order of its `input` nodes.
    """

    name: str
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    types: Mapping[str, TensorType] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        types: dict[str, TensorType] = {}
        for n in self.nodes:
            if not isinstance(n.name, str) or not n.name:
                raise ProgramError(f"a node has an invalid name {n.name!r}")
            if n.name in types:
                raise ProgramError(f"node '{n.name}': defined twice")
            _check_node(n)
            for src in n.inputs:
                if src not in types:
                    later = any(m.name == src for m in self.nodes)
                    why = "is defined later (cycle or out of order)" if later else "is not defined"
                    raise ProgramError(f"node '{n.name}': input '{src}' {why}")
            types[n.name] = infer_type(n, [types[s] for s in n.inputs])
        if not self.outputs:
            raise ProgramError(f"program '{self.name}': has no outputs")
        for out in self.outputs:
            if out not in types:
                raise ProgramError(f"program '{self.name}': output '{out}' is not a node")
            if types[out].dtype == "const":
                raise ProgramError(f"program '{self.name}': output '{out}' is a constant")
            if types[out].dtype in INDEX_DTYPES:
                raise ProgramError(f"program '{self.name}': output '{out}' is an integer tensor "
                                   f"({types[out].dtype}); outputs are float tensors")
        object.__setattr__(self, "types", types)

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == "input")

    # --- canonical hash -------------------------------------------------
    @cached_property
    def structural_keys(self) -> dict[str, str]:
        """Per node, a digest of the computation that defines it.

        Inputs are identified by their position in the signature, so renaming nodes
        or reordering independent ones leaves every digest unchanged.
        """
        positions = {n.name: i for i, n in enumerate(self.inputs)}
        keys: dict[str, str] = {}
        for n in self.nodes:
            if n.op == "input":
                payload = ["input", positions[n.name], list(map(str, n.attr("shape"))), n.attr("dtype")]
            else:
                payload = [n.op, [keys[s] for s in n.inputs], [[k, v] for k, v in n.attrs]]
            keys[n.name] = hashlib.sha256(json.dumps(payload).encode()).hexdigest()
        return keys

    @cached_property
    def canonical_hash(self) -> str:
        keys = self.structural_keys
        payload = {"inputs": [keys[n.name] for n in self.inputs], "outputs": [keys[o] for o in self.outputs]}
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:32]

    # --- JSON -------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "ir_version": IR_VERSION,
            "name": self.name,
            "nodes": [{"name": n.name, "op": n.op, "inputs": list(n.inputs),
                       "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in n.attrs}}
                      for n in self.nodes],
            "outputs": list(self.outputs),
        }



def bind_shape(shape: Shape, num_tokens: int) -> tuple[int, ...]:
    return tuple(num_tokens if d == NUM_TOKENS else d for d in shape)
