"""Symbolic hierarchical kernel graphs (sGraphs).

An `SGraph` implements a `Program` as a sequence of kernels over named tensors:
`LibraryKernel`s (one IR op, run by torch) and `BlockKernel`s (graph-defined
kernels). A block kernel is one thread block's program: a grid of symbolic
extents, an optional for-loop of symbolic range, and a block graph of IR
nodes plus three block-only ops:

- ``load``  (attrs ``tensor``, ``imap``, ``fmap``): the tile of a kernel tensor.
  ``imap[a]`` is the data dim grid axis ``a`` partitions (None: replicated);
  ``fmap`` is the data dim the for-loop partitions (None: loaded once, before the loop).
- ``accum`` (attrs ``kind``): a for-loop accumulator: ``sum``, ``mean``
  (sum / range), ``max``, or ``rescaled_sum`` whose second input is a ``max``
  accumulator: ``acc = acc * exp(m_old - m_new) + x`` (online softmax). Inside
  the loop a ``max`` accumulator reads as the running max; after it, the final one.
- ``store`` (attrs ``tensor``, ``omap``, optional ``fmap``): write a value as the tile of a
  kernel tensor; with ``fmap``, a loop-body value is written every iteration as the tile the
  for-loop selects along that dim (a fused producer's own output, e.g. the residual sum).

Block graphs may also hold ``slice``, ``gather`` and ``concat``, placed so that Triton renders
them without slicing registers (`_check_indirection`): a slice or gather reads a *window*, a load
followed by slices and at most one gather (rendered as one windowed, strided or indexed load), on
dims the load maps no grid axis or loop onto; a gather's index is a load of an integer tensor; a
concat feeds only stores (one per part, at its offset) and other concats.

Tile dims are sympy expressions of the symbols. A grid axis over the symbolic
``num_tokens`` dim is parametrised by its block of tokens (`over_tokens`),
because num_tokens is only known at launch: its extent is ceil(num_tokens / symbol)
and the last block is masked. Every other division must be exact.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any, Callable, Mapping

import sympy

from prism_serve.errors import ProgramError, SGraphError
from prism_serve.optimize.ir.dims import parse_dim, render
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import (INDEX_DTYPES, NUM_TOKENS, Node, Program, TensorType, code_spelling,
                                             infer_type)

SGRAPH_VERSION = 1
TOKENS = sympy.Symbol(NUM_TOKENS, positive=True, integer=True)
ACCUM_KINDS = (Op.SUM, Op.MEAN, Op.MAX, "rescaled_sum")
BLOCK_OPS = ("load", "accum", "store")
Expr = sympy.Expr


def sym(name: str) -> sympy.Symbol:
    return TOKENS if name == NUM_TOKENS else sympy.Symbol(name, positive=True, integer=True)


def to_expr(dim: Any) -> Expr:
    if isinstance(dim, sympy.Basic):
        return dim
    if isinstance(dim, int):
        return sympy.Integer(dim)
    if isinstance(dim, str):  # parsed by the dim grammar, never evaluated
        return parse_dim(dim, sym)
    raise SGraphError(f"invalid dim {dim!r}")


MAX_GRID_AXES = 6  # logical grid axes of a block kernel; Triton launches at most 3 (`launch_dims`)


def launch_dims(axes: int) -> tuple[tuple[int, ...], ...]:
    """The logical grid axes each of Triton's launch dims carries. Up to 3 axes map one to one;
    beyond, axes 1 .. n-2 are folded row-major into launch dim 1, so axis 0 (the token axis, whose
    extent is only known at launch) keeps the largest launch dim and the last axis its own."""
    if axes <= 3:
        return tuple((a,) for a in range(axes))
    return (0,), tuple(range(1, axes - 1)), (axes - 1,)


@dataclass(frozen=True)
class GridAxis:
    """One grid dim. `symbol` is its extent, or for a token axis the tokens per block."""

    symbol: str
    over_tokens: bool = False


@dataclass(frozen=True)
class TensorDecl:
    name: str
    shape: tuple[Expr, ...]
    dtype: str


@dataclass(frozen=True)
class LibraryKernel:
    """One IR op run as a library kernel (torch); `op.name` is the tensor it writes."""

    op: Node


@dataclass(frozen=True)
class BlockKernel:
    name: str
    grid: tuple[GridAxis, ...]
    forloop: str | None  # the symbol of the loop range, or None for no loop
    nodes: tuple[Node, ...]

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @property
    def loads(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "load"]

    @property
    def stores(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "store"]

    @cached_property
    def stages(self) -> dict[str, str]:
        """'pre' (before the loop), 'loop' (every iteration) or 'post' (after it), per node."""
        stages: dict[str, str] = {}
        for n in self.nodes:
            if n.op == "load":
                stages[n.name] = "loop" if n.attr("fmap") is not None else "pre"
            elif n.op == "accum":
                stages[n.name] = "post"
            else:
                src = [stages.get(s, "pre") for s in n.inputs]  # unknown inputs are reported by the check
                stages[n.name] = "loop" if "loop" in src else "post" if "post" in src else "pre"
        return stages


Kernel = LibraryKernel | BlockKernel


def tile_shape(kernel: BlockKernel, shape: tuple[Expr, ...], imap: tuple, fmap: int | None) -> tuple[Expr, ...]:
    """The tile one block sees of a tensor of `shape` under `imap` / `fmap`."""
    tile = list(shape)
    for axis, dim in zip(kernel.grid, imap):
        if dim is None:
            continue
        tile[dim] = sym(axis.symbol) if axis.over_tokens else tile[dim] / sym(axis.symbol)
    if fmap is not None:
        tile[fmap] = tile[fmap] / sym(kernel.forloop)
    return tuple(sympy.simplify(t) for t in tile)


@dataclass(frozen=True)
class SGraph:
    """A symbolic kernel graph implementing `program`. Validated at construction."""

    name: str
    program: Program
    intermediates: tuple[TensorDecl, ...]
    kernels: tuple[Kernel, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_types", _check_sgraph(self))

    @property
    def tensors(self) -> dict[str, TensorDecl]:
        return self._types[0]

    def block_types(self, kernel: BlockKernel) -> dict[str, TensorType]:
        """Symbolic tile type of every node of a block kernel."""
        return self._types[1][kernel.name]

    @cached_property
    def symbols(self) -> tuple[str, ...]:
        names: set[str] = set()
        for k in self.kernels:
            if isinstance(k, BlockKernel):
                names |= {a.symbol for a in k.grid} | ({k.forloop} if k.forloop else set())
        for t in self.intermediates:
            names |= {str(s) for d in t.shape for s in d.free_symbols}
        return tuple(sorted(names - {NUM_TOKENS}))

    # --- JSON -------------------------------------------------------------
    def to_json(self) -> dict:
        def kernel_json(k: Kernel) -> dict:
            if isinstance(k, LibraryKernel):
                return {"kind": "library", "op": _node_json(k.op)}
            return {"kind": "block", "name": k.name, "forloop": k.forloop,
                    "grid": [{"symbol": a.symbol, "over_tokens": a.over_tokens} for a in k.grid],
                    "nodes": [_node_json(n) for n in k.nodes]}
        return {"sgraph_version": SGRAPH_VERSION, "name": self.name, "program": self.program.to_json(),
                "intermediates": [{"name": t.name, "shape": [render(d) for d in t.shape], "dtype": t.dtype}
                                  for t in self.intermediates],
                "kernels": [kernel_json(k) for k in self.kernels]}



def _node_json(n: Node) -> dict:
    return {"name": n.name, "op": n.op, "inputs": list(n.inputs),
            "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in n.attrs}}


def _fail(where: str, msg: str) -> SGraphError:
    return SGraphError(f"{where}: {msg}")


def _check_names(g: SGraph) -> None:
    """One name, one thing, also as generated code spells it (each non-word character as "_"):
    kernels (a launcher per name), tensors (an argument per name), intermediates apart from the
    Program's inputs and outputs (a buffer must not shadow an input)."""
    prog = g.program
    tensors = [n.name for n in prog.inputs] + list(prog.outputs) + [t.name for t in g.intermediates]
    for what, names in (("kernel", [k.name for k in g.kernels if isinstance(k, BlockKernel)]), ("tensor", tensors)):
        seen: dict[str, str] = {}
        for name in names:
            spelled = code_spelling(name)
            if spelled in seen:
                raise SGraphError(f"sGraph '{g.name}': {what} names '{seen[spelled]}' and '{name}' "
                                  f"are the same name in generated code")
            seen[spelled] = name


def _check_sgraph(g: SGraph) -> tuple[dict[str, TensorDecl], dict[str, dict[str, TensorType]]]:
    _check_names(g)
    prog = g.program
    tensors: dict[str, TensorDecl] = {
        n.name: TensorDecl(n.name, tuple(to_expr(d) for d in n.attr("shape")), n.attr("dtype"))
        for n in prog.inputs}
    declared = {t.name: t for t in g.intermediates}
    for out in prog.outputs:
        t = prog.types[out]
        declared[out] = TensorDecl(out, tuple(to_expr(d) for d in t.shape), t.dtype)
    written: set[str] = set(tensors)
    block_types: dict[str, dict[str, TensorType]] = {}
    for k in g.kernels:
        if isinstance(k, LibraryKernel):
            where = f"sGraph '{g.name}' library kernel '{k.op.name}'"
            for s in k.op.inputs:
                if s not in written:
                    raise _fail(where, f"reads tensor '{s}' before any kernel writes it")
            if k.op.name not in declared:
                raise _fail(where, f"writes undeclared tensor '{k.op.name}'")
            try:
                t = infer_type(k.op, [TensorType(tensors[s].shape, tensors[s].dtype) for s in k.op.inputs])
            except ProgramError as exc:
                raise _fail(where, str(exc)) from None
            if tuple(t.shape) != declared[k.op.name].shape:
                raise _fail(where, f"produces shape {t.shape}, tensor is declared {declared[k.op.name].shape}")
            tensors[k.op.name] = declared[k.op.name]
            written.add(k.op.name)
        else:
            block_types[k.name] = _check_block(g.name, k, tensors, declared, written)
            for st in k.stores:
                tensors[st.attr("tensor")] = declared[st.attr("tensor")]
                written.add(st.attr("tensor"))
    missing = [o for o in prog.outputs if o not in written]
    if missing:
        raise SGraphError(f"sGraph '{g.name}': no kernel writes outputs {missing}")
    return tensors, block_types


def _check_block(gname: str, k: BlockKernel, tensors: dict, declared: dict, written: set) -> dict[str, TensorType]:
    where = f"sGraph '{gname}' kernel '{k.name}'"
    if not 1 <= len(k.grid) <= MAX_GRID_AXES:
        raise _fail(where, f"grid must have 1 to {MAX_GRID_AXES} dims, has {len(k.grid)}")
    folded = [k.grid[a].symbol for dims in launch_dims(len(k.grid)) if len(dims) > 1 for a in dims
              if k.grid[a].over_tokens]
    if folded:
        raise _fail(where, f"token axis {folded[0]} must be grid axis 0 or the last when the grid has over 3 dims")
    if len({a.symbol for a in k.grid} | ({k.forloop} if k.forloop else set())) != len(k.grid) + bool(k.forloop):
        raise _fail(where, "grid and for-loop symbols must be distinct")
    types: dict[str, TensorType] = {}
    has_accum = False
    for n in k.nodes:
        at = f"{where} node '{n.name}'"
        if n.name in types:
            raise _fail(at, "defined twice")
        for s in n.inputs:
            if s not in types:
                raise _fail(at, f"input '{s}' is not an earlier node of the block graph")
        if n.op in ("load", "store"):
            name = n.attr("tensor")
            table = tensors if n.op == "load" else declared
            if n.op == "store" and name not in declared:
                raise _fail(at, f"stores into '{name}', which is neither an intermediate nor an output")
            if name not in table and name not in declared:
                raise _fail(at, f"names unknown tensor '{name}'")
            if n.op == "load" and name not in written:
                raise _fail(at, f"loads tensor '{name}' before any kernel writes it")
            decl = table[name]
            imap = n.attr("imap" if n.op == "load" else "omap")
            fmap = dict(n.attrs).get("fmap")
            _check_maps(at, k, decl, imap, fmap)
            tile = tile_shape(k, decl.shape, imap, fmap)
            if n.op == "load":
                types[n.name] = TensorType(tile, decl.dtype)
            else:
                value = types[n.inputs[0]]
                if value.dtype in INDEX_DTYPES:
                    raise _fail(at, f"stores an integer tile ({value.dtype}); integer tensors are inputs only")
                _check_concat_store(at, k, n, decl, types)
                if [d for d in value.shape if d != 1] != [d for d in tile if d != 1]:
                    raise _fail(at, f"value tile {value.shape} does not fit the tile {tile} of '{name}'")
                if fmap is None and k.stages[n.inputs[0]] == "loop":
                    raise _fail(at, "stores a value of the loop body; accumulate it, or map the loop (fmap)")
                if fmap is not None and k.stages[n.inputs[0]] != "loop":
                    raise _fail(at, "a store with a for-loop map needs a value of the loop body")
                types[n.name] = value
        elif n.op == "accum":
            has_accum = True
            kind = n.attr("kind")
            if kind not in ACCUM_KINDS:
                raise _fail(at, f"accumulator kind {kind!r} is not one of {ACCUM_KINDS}")
            if k.forloop is None:
                raise _fail(at, "accumulator in a kernel without a for-loop")
            if k.stages[n.inputs[0]] != "loop":
                raise _fail(at, "accumulates a value that does not change in the loop")
            if (kind == "rescaled_sum") != (len(n.inputs) == 2):
                raise _fail(at, "rescaled_sum takes (value, max accumulator); other kinds take one input")
            if types[n.inputs[0]].dtype in INDEX_DTYPES or k.by_name[n.inputs[0]].op == Op.CONCAT:
                raise _fail(at, "accumulates an integer tile or a concat")
            if kind == "rescaled_sum":
                m = k.by_name[n.inputs[1]]
                if m.op != "accum" or m.attr("kind") != Op.MAX:
                    raise _fail(at, f"rescales by '{m.name}', which is not a max accumulator")
            types[n.name] = types[n.inputs[0]]
        else:
            _check_indirection(at, k, n, types)
            if k.stages[n.name] == "loop":
                bad = [s for s in n.inputs if k.stages[s] == "post" and
                       not (k.by_name[s].op == "accum" and k.by_name[s].attr("kind") == Op.MAX)]
                if bad:
                    raise _fail(at, f"uses post-loop values {bad} inside the loop")
            try:
                types[n.name] = infer_type(n, [types[s] for s in n.inputs])
            except ProgramError as exc:
                raise _fail(where, str(exc)) from None
    if k.forloop is not None and not has_accum:
        raise _fail(where, "has a for-loop but no accumulator")
    if not k.stores:
        raise _fail(where, "stores nothing")
    stored = [st.attr("tensor") for st in k.stores]
    twice = sorted({t for t in stored if stored.count(t) > 1})
    if twice:  # blocks would race: the proof sees one store, a GPU runs both in any order
        raise _fail(where, f"stores tensor '{twice[0]}' twice; one store per tensor per kernel")
    both = sorted(set(stored) & {n.attr("tensor") for n in k.nodes if n.op == "load"})
    if both:  # one block may read what another has already overwritten
        raise _fail(where, f"loads and stores tensor '{both[0]}'")
    return types


WINDOW_OPS = ("load", Op.SLICE, Op.GATHER)  # the nodes of a window: one load, then slices and one gather


def window_source(k: BlockKernel, types: Mapping[str, TensorType], name: str, dim: int) -> tuple[Node, int | None]:
    """The load under window node `name` and the dim of its tensor that the window's `dim` reads
    (None: a dim of the gather's index)."""
    n = k.by_name[name]
    dim %= len(types[name].shape)
    if n.op == "load":
        return n, dim
    if n.op == Op.SLICE:
        return window_source(k, types, n.inputs[0], dim)
    g = n.attr("dim") % len(types[n.inputs[0]].shape)
    rank = len(types[n.inputs[1]].shape)
    if g <= dim < g + rank:
        return window_source(k, types, n.inputs[0], g)[0], None
    return window_source(k, types, n.inputs[0], dim if dim < g else dim - rank + 1)


def _gathers(k: BlockKernel, name: str) -> bool:
    """Whether window node `name` holds a gather."""
    n = k.by_name[name]
    return n.op == Op.GATHER or (n.op == Op.SLICE and _gathers(k, n.inputs[0]))


def _check_indirection(at: str, k: BlockKernel, n: Node, types: dict[str, TensorType]) -> None:
    """The placement rules of slice, gather and concat in a block graph (see the module docstring)."""
    read_concat = [s for s in n.inputs if k.by_name[s].op == Op.CONCAT]
    if read_concat and n.op != Op.CONCAT:
        raise _fail(at, f"reads concat '{read_concat[0]}'; a concat feeds only stores and other concats")
    if n.op not in (Op.SLICE, Op.GATHER):
        return
    src = n.inputs[0]
    if k.by_name[src].op not in WINDOW_OPS:
        raise _fail(at, f"{n.op} of '{src}', a computed value: a {n.op} reads a load (or a window of one), "
                        f"so that it renders as one windowed or indexed load")
    rank = len(types[src].shape)
    dim = n.attr("dim")
    if not -rank <= dim < rank:
        return  # the type rule names it
    load, tdim = window_source(k, types, src, dim)
    if tdim is None:
        raise _fail(at, f"{n.op} along dim {dim % rank} of '{src}', a dim of its gather's index")
    if tdim in load.attr("imap") or load.attr("fmap") == tdim:
        raise _fail(at, f"{n.op} along dim {tdim} of '{load.attr('tensor')}', which load '{load.name}' "
                        f"partitions over the grid or the loop; that dim must be whole in the tile")
    if not types[load.name].shape[tdim].is_Integer:
        raise _fail(at, f"{n.op} along dim {tdim} of '{load.attr('tensor')}', which is {NUM_TOKENS}; "
                        f"it must be a fixed size")
    if n.op == Op.GATHER:
        index = k.by_name[n.inputs[1]]
        if _gathers(k, src):
            raise _fail(at, f"gathers from '{src}', which is already gathered; one gather per window")
        if index.op != "load" or types[index.name].dtype not in INDEX_DTYPES:
            raise _fail(at, f"gather index '{index.name}' must be a load of an integer tensor")
        if types[src].shape[dim % rank] != types[load.name].shape[tdim]:
            raise _fail(at, f"gathers along dim {tdim} of '{load.attr('tensor')}', which a slice narrowed; "
                            f"gather first, then slice")


def _check_concat_store(at: str, k: BlockKernel, st: Node, decl: TensorDecl, types: dict[str, TensorType]) -> None:
    """A store of a concat writes each part at its offset: along fixed dims the store leaves whole."""
    value = k.by_name[st.inputs[0]]
    if value.op != Op.CONCAT:
        return
    rank = len(decl.shape)
    if len(types[value.name].shape) != rank:
        raise _fail(at, f"stores concat '{value.name}' of rank {len(types[value.name].shape)} into a tensor "
                        f"of rank {rank}; a stored concat has the tensor's rank")
    omap, fmap = st.attr("omap"), dict(st.attrs).get("fmap")
    stack = [value]
    while stack:
        c = stack.pop()
        d = c.attr("dim") % rank
        if d in omap or fmap == d or not decl.shape[d].is_Integer:
            raise _fail(at, f"stores concat '{c.name}' along dim {d}, which the store partitions over the grid "
                            f"or the loop (or is {NUM_TOKENS}); that dim must be whole and fixed in the tile")
        stack += [k.by_name[s] for s in c.inputs if k.by_name[s].op == Op.CONCAT]


def _check_maps(at: str, k: BlockKernel, decl: TensorDecl, imap: tuple, fmap: int | None) -> None:
    rank = len(decl.shape)
    if len(imap) != len(k.grid):
        raise _fail(at, f"map has {len(imap)} entries for a grid of {len(k.grid)} dims")
    dims = [d for d in imap if d is not None]
    if any(not isinstance(d, int) or not 0 <= d < rank for d in dims) or len(set(dims)) != len(dims):
        raise _fail(at, f"map {imap} must name distinct dims of '{decl.name}' (rank {rank})")
    for axis, d in zip(k.grid, imap):
        if d is not None and (decl.shape[d] == TOKENS) != axis.over_tokens:
            raise _fail(at, f"grid axis '{axis.symbol}' {'must' if not axis.over_tokens else 'can only'} "
                        f"partition {'a fixed' if not axis.over_tokens else 'the num_tokens'} dim")
    if fmap is not None:
        if k.forloop is None:
            raise _fail(at, "has a for-loop map in a kernel without a for-loop")
        if not isinstance(fmap, int) or not 0 <= fmap < rank or decl.shape[fmap].free_symbols & {TOKENS}:
            raise _fail(at, f"for-loop map {fmap} must name a fixed dim of '{decl.name}'")


# --- instantiation ---------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _dim_function(expr: Expr) -> tuple[tuple[str, ...], Callable]:
    names = tuple(sorted(str(s) for s in expr.free_symbols))
    return names, sympy.lambdify([sym(n) for n in names], expr, modules=[{"floor": math.floor}, "math"])


_DIM_VALUES: dict[tuple, Fraction] = {}  # (compiled dim, its symbols' values) -> value: tuning re-reads the same few
_DIM_VALUES_MAX = 1 << 20


def evaluate_dim(expr: Expr, values: Mapping[str, int]) -> Fraction:
    """Exact value of a dim expression under `values` (fast: compiled once per expression, each
    value computed once per assignment of the expression's own symbols)."""
    if isinstance(expr, int) or expr.is_Number:
        return Fraction(int(expr)) if isinstance(expr, int) or expr.is_Integer else Fraction(str(expr))
    names, fn = _dim_function(expr)
    try:
        key = (fn, tuple(values[n] for n in names))
    except KeyError:
        raise SGraphError(f"dim {expr} depends on unassigned {[n for n in names if n not in values]}") from None
    value = _DIM_VALUES.get(key)
    if value is None:
        if len(_DIM_VALUES) >= _DIM_VALUES_MAX:
            _DIM_VALUES.clear()
        value = _DIM_VALUES[key] = Fraction(fn(*map(Fraction, key[1])))
    return value


BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


def _exact(gname: str, where: str, dim: Expr, values: dict) -> int:
    """Evaluate a tile dim; it must be a positive integer (token dims are their block size)."""
    try:
        value = evaluate_dim(dim, values)
    except SGraphError as exc:
        raise SGraphError(f"sGraph '{gname}' {where}: {exc}") from None
    if value.denominator != 1 or value < 1:
        raise SGraphError(f"sGraph '{gname}' {where}: dim {dim} = {value} under the assignment; "
                          f"the sizes do not divide exactly")
    return int(value)
