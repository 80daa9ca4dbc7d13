"""The typed loader: Program and sGraph JSON from a registry or an export, parsed against a schema.

Stored JSON is untrusted data. Every value is checked for its type and range before an IR
object is built from it: ints are ints within bounds, bools real JSON bools, floats finite,
names follow a small identifier grammar, enum-like attributes come from their allowed set, and
each sGraph dim is parsed by `dims.parse_dim` against the sGraph's own symbols. Unknown keys
are refused. Nothing here evaluates text; what it returns holds only ints, bools, floats,
validated names and sympy expressions built by the dim parser.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection
from typing import Any

from prism_serve.errors import PrismError, ProgramError, SGraphError
from prism_serve.optimize.ir import dims as D
from prism_serve.optimize.ir import sgraph as S
from prism_serve.optimize.ir.ops import OPS as OP_DEFS
from prism_serve.optimize.ir.ops import Op, OpDef
from prism_serve.optimize.ir.program import (
    ARITY,
    DEFAULTS,
    DTYPES,
    INDEX_DTYPES,
    IR_VERSION,
    NUM_TOKENS,
    OPS,
    TF32,
    Node,
    Program,
)
from prism_serve.optimize.ir.sgraph import ACCUM_KINDS, sym

# Names of nodes, tensors, kernels, programs and sGraphs: dotted identifiers (a split's partial
# tensor is "<name>.part"); symbols: plain identifiers, as the dim grammar reads them.
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}(\.[A-Za-z_][A-Za-z0-9_]{0,63}){0,3}")
RESERVED_SYMBOLS = (NUM_TOKENS, "cdiv")
MAX_RANK = 8
MAX_NODES = 1024
MAX_KERNELS = 64
MAX_INPUTS = 4
MAX_JSON_DEPTH = 48
MAX_INT_DIGITS = 100  # larger ints reach the typed checks, which name the field


# --- strict JSON -------------------------------------------------------------------

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r:.60}")
        out[key] = value
    return out


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer {text[:20]}... has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is not finite")
    return value


def _constant(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")


def loads(text: str | bytes, error: type[PrismError] = SGraphError, what: str = "JSON") -> Any:
    """Parse untrusted JSON strictly: duplicate keys, NaN / Infinity, integers of more than
    100 digits and nesting deeper than MAX_JSON_DEPTH are refused with `error` (one line)."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except RecursionError:
        raise error(f"{what} is nested too deeply (limit {MAX_JSON_DEPTH})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} does not parse (not JSON): {str(exc).splitlines()[0][:200]}") from None
    except ValueError as exc:  # one of the hooks above refused a value
        raise error(f"{what} is refused: {str(exc).splitlines()[0][:200]}") from None
    check_depth(data, error, what)
    return data


def check_depth(data: Any, error: type[PrismError] = SGraphError, what: str = "JSON") -> None:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise error(f"{what} is nested too deeply (limit {MAX_JSON_DEPTH})")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


# --- typed values ------------------------------------------------------------------

def show(value: Any) -> str:
    return f"{value!r:.60}"


def fields(obj: Any, required: Collection[str], optional: Collection[str], where: str,
           error: type[PrismError]) -> dict:
    """`obj` must be an object with every required key and no key outside required | optional."""
    if not isinstance(obj, dict):
        raise error(f"{where} must be an object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise error(f"{where} lacks fields: {sorted(missing)}")
    extra = [k for k in obj if k not in required and k not in optional]
    if extra:
        raise error(f"{where} has unknown fields {sorted(map(str, extra))[:5]}")
    return obj


def int_in(value: Any, lo: int, hi: int, where: str, error: type[PrismError]) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise error(f"{where} must be int in [{lo}, {hi}], got {show(value)}")
    return value


def float_in(value: Any, lo: float, hi: float, where: str, error: type[PrismError], *,
             open_lo: bool = False) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and (lo < value if open_lo else lo <= value) \
        and value <= hi
    if not ok:
        raise error(f"{where} must be float in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {show(value)}")
    return float(value)


def boolean(value: Any, where: str, error: type[PrismError]) -> bool:
    if type(value) is not bool:
        raise error(f"{where} must be bool (true or false), got {show(value)}")
    return value


def name(value: Any, where: str, error: type[PrismError]) -> str:
    if type(value) is not str or not NAME.fullmatch(value):
        raise error(f"{where} must be a name (dotted identifier of at most 64 characters per part), "
                    f"got {show(value)}")
    return value


def symbol(value: Any, where: str, error: type[PrismError]) -> str:
    if type(value) is not str or not D.NAME.fullmatch(value) or value in RESERVED_SYMBOLS:
        raise error(f"{where} must be a symbol (identifier, not {' or '.join(RESERVED_SYMBOLS)}), "
                    f"got {show(value)}")
    return value


def one_of(value: Any, allowed: Collection[str], where: str, error: type[PrismError]) -> str:
    if type(value) is not str or value not in allowed:
        raise error(f"{where} {show(value)} is not one of {tuple(allowed)}")
    return value


def listed(value: Any, lo: int, hi: int, where: str, error: type[PrismError]) -> list | tuple:
    """A JSON array (or, from memory, a tuple) of `lo` to `hi` items."""
    if type(value) not in (list, tuple) or not lo <= len(value) <= hi:
        raise error(f"{where} must be a list of {lo} to {hi} items, got {show(value)}")
    return value


# --- attributes ---------------------------------------------------------------------

Check = Callable[[Any, str, type[PrismError]], Any]


def _shape(value: Any, where: str, error: type[PrismError]) -> tuple:
    return tuple(d if d == NUM_TOKENS else int_in(d, 1, D.MAX_INT, f"{where} dim", error)
                 for d in listed(value, 0, MAX_RANK, where, error))


def _map(value: Any, where: str, error: type[PrismError]) -> tuple:
    return tuple(None if d is None else int_in(d, 0, MAX_RANK - 1, f"{where} entry", error)
                 for d in listed(value, 1, 3, where, error))


def _opt_index(value: Any, where: str, error: type[PrismError]) -> int | None:
    return None if value is None else int_in(value, 0, MAX_RANK - 1, where, error)


class OneOf:
    """An attribute whose value is one of a few names (its error reads "<node>: <key> 'x' is not one of")."""

    def __init__(self, allowed: tuple[str, ...]):
        self.allowed = allowed

    def __call__(self, value: Any, where: str, error: type[PrismError]) -> str:
        return one_of(value, self.allowed, where, error)


DIM_ATTR = lambda v, w, e: int_in(v, -MAX_RANK, MAX_RANK - 1, w, e)  # noqa: E731
_EPS = lambda v, w, e: float_in(v, 0.0, 1.0, w, e, open_lo=True)  # noqa: E731
_VALUE = lambda v, w, e: float_in(v, -1e30, 1e30, w, e)  # noqa: E731
MAX_INDEX = 2**20  # a slice's start / stop / step (the Program's type rule bounds them by the dim's size)
_START = lambda v, w, e: int_in(v, 0, MAX_INDEX, w, e)  # noqa: E731
_STOP_STEP = lambda v, w, e: int_in(v, 1, MAX_INDEX, w, e)  # noqa: E731

# The check of each IR op attribute the registry declares (`OpDef.attrs`), by its name: its bounds
ATTR_CHECKS: dict[str, Check] = {"shape": _shape, "dtype": OneOf(DTYPES + INDEX_DTYPES), "value": _VALUE,
                                 "eps": _EPS, "dim": DIM_ATTR, "keepdim": boolean, "transpose_b": boolean,
                                 "start": _START, "stop": _STOP_STEP, "step": _STOP_STEP, "interleave": boolean}


def _op_schema(d: OpDef) -> tuple[dict[str, Check], dict[str, Check]]:
    """An op's required attributes (those without a default) and optional ones, each with its check."""
    return ({k: ATTR_CHECKS[k] for k in d.attrs if k not in d.defaults},
            {k: ATTR_CHECKS[k] for k in d.attrs if k in d.defaults})


# required and optional attributes per op, each with its check: the registry's ops, a block kernel's
# matmul precision (`program.is_tf32`) and the block-level ops
ATTR_SCHEMA: dict[str, tuple[dict[str, Check], dict[str, Check]]] = \
    {op: _op_schema(d) for op, d in OP_DEFS.items() if d.attrs}
ATTR_SCHEMA[Op.MATMUL][1]["precision"] = OneOf((TF32,))
ATTR_SCHEMA |= {
    "load": ({"tensor": name, "imap": _map}, {"fmap": _opt_index}),
    "store": ({"tensor": name, "omap": _map}, {"fmap": _opt_index}),
    "accum": ({"kind": OneOf(ACCUM_KINDS)}, {}),
}
BLOCK_ARITY = {"load": 0, "store": 1, "accum": (1, 2)}


def parse_node(raw: Any, index: int, ops: Collection[str], error: type[PrismError]) -> Node:
    """One node from JSON: name, op from `ops`, inputs by name, typed attributes."""
    if not isinstance(raw, dict) or not {"name", "op"} <= set(raw):
        raise error(f"program JSON: node #{index} must be an object with 'name' and 'op'")
    fields(raw, ("name", "op"), ("inputs", "attrs"), f"node #{index}", error)
    nname = name(raw["name"], f"node #{index} name", error)
    where = f"node '{nname}'"
    op = raw["op"]
    if type(op) is not str or op not in ops:
        raise error(f"{where}: unsupported op {show(op)} (supported: {', '.join(ops)})")
    inputs = tuple(name(s, f"{where} input", error) for s in listed(raw.get("inputs", []), 0, MAX_INPUTS,
                                                                      f"{where}: 'inputs'", error))
    arity = BLOCK_ARITY.get(op, ARITY.get(op))
    allowed = arity if isinstance(arity, tuple) else (arity,)
    if len(inputs) not in allowed:
        raise error(f"{where}: op {op} takes {' or '.join(map(str, allowed))} inputs, got {len(inputs)}")
    attrs = raw.get("attrs", {})
    if not isinstance(attrs, dict):
        raise error(f"{where}: 'attrs' must be an object")
    required, optional = ATTR_SCHEMA.get(op, ({}, {}))
    for key in required:
        if key not in attrs:
            raise error(f"{where}: op {op} needs attribute {key!r}")
    extra = sorted(str(k) for k in attrs if k not in required and k not in optional)
    if extra:
        raise error(f"{where}: unknown attributes {extra[:5]} for op {op}")
    typed = dict(DEFAULTS.get(op, {}))
    for key, value in attrs.items():
        check = (required | optional)[key]
        typed[key] = check(value, f"{where}: {key}" if isinstance(check, OneOf) else f"{where}: attribute {key!r}",
                           error)
    if op == "load":
        typed.setdefault("fmap", None)
    elif op == "store" and typed.get("fmap", 0) is None:
        del typed["fmap"]
    return Node(nname, op, inputs, tuple(sorted(typed.items())))


# --- Program ------------------------------------------------------------------------

def program_from_json(data: Any) -> Program:
    """A Program from untrusted JSON (text or parsed); ProgramError with the reason otherwise."""
    if isinstance(data, (str, bytes)):
        data = loads(data, ProgramError, "program JSON")
    if not isinstance(data, dict):
        raise ProgramError("program JSON must be an object")
    fields(data, ("ir_version", "name", "nodes", "outputs"), (), "program JSON", ProgramError)
    if data["ir_version"] != IR_VERSION or type(data["ir_version"]) is not int:
        raise ProgramError(f"program JSON has ir_version {show(data['ir_version'])}, expected {IR_VERSION}")
    if not isinstance(data["nodes"], list) or not isinstance(data["outputs"], list):
        raise ProgramError("program JSON: 'nodes' and 'outputs' must be lists")
    pname = name(data["name"], "program name", ProgramError)
    raw_nodes = listed(data["nodes"], 1, MAX_NODES, "program JSON: 'nodes'", ProgramError)
    nodes = tuple(parse_node(raw, i, OPS, ProgramError) for i, raw in enumerate(raw_nodes))
    outputs = tuple(name(o, "program output", ProgramError)
                    for o in listed(data["outputs"], 1, MAX_NODES, "program JSON: 'outputs'", ProgramError))
    return Program(pname, nodes, outputs)


# --- sGraph -------------------------------------------------------------------------

BLOCK_NODE_OPS = tuple(op for op in OPS if op != "input") + ("load", "store", "accum")
LIBRARY_OPS = tuple(op for op in OPS if op not in ("input", "const"))


def sgraph_from_json(data: Any) -> S.SGraph:
    """An SGraph from untrusted JSON (text or parsed); SGraphError / ProgramError with the reason."""
    if isinstance(data, (str, bytes)):
        data = loads(data, SGraphError, "sGraph JSON")
    E = SGraphError
    fields(data, ("sgraph_version", "name", "program", "intermediates", "kernels"), (), "sGraph JSON", E)
    if data["sgraph_version"] != S.SGRAPH_VERSION or type(data["sgraph_version"]) is not int:
        raise E(f"sGraph JSON has version {show(data['sgraph_version'])}, expected {S.SGRAPH_VERSION}")
    gname = name(data["name"], "sGraph name", E)
    program = program_from_json(data["program"])
    raw_kernels = listed(data["kernels"], 1, MAX_KERNELS, "sGraph JSON: 'kernels'", E)
    kernels, symbols = [], set()
    for i, k in enumerate(raw_kernels):
        where = f"sGraph JSON: kernel #{i}"
        if not isinstance(k, dict) or k.get("kind") not in ("library", "block"):
            raise E(f"malformed sGraph JSON: {where} must be an object of kind 'library' or 'block'")
        if k["kind"] == "library":
            fields(k, ("kind", "op"), (), f"malformed sGraph JSON: {where}", E)
            kernels.append(S.LibraryKernel(parse_node(k["op"], 0, LIBRARY_OPS, E)))
            continue
        fields(k, ("kind", "name", "forloop", "grid", "nodes"), (), f"malformed sGraph JSON: {where}", E)
        grid = []
        for a in listed(k["grid"], 1, S.MAX_GRID_AXES, f"{where} grid", E):
            fields(a, ("symbol", "over_tokens"), (), f"{where} grid axis", E)
            grid.append(S.GridAxis(symbol(a["symbol"], f"{where} grid symbol", E),
                                   boolean(a["over_tokens"], f"{where} over_tokens", E)))
        forloop = None if k["forloop"] is None else symbol(k["forloop"], f"{where} forloop", E)
        nodes = tuple(parse_node(n, j, BLOCK_NODE_OPS, E)
                      for j, n in enumerate(listed(k["nodes"], 1, MAX_NODES, f"{where} nodes", E)))
        kernels.append(S.BlockKernel(name(k["name"], f"{where} name", E), tuple(grid), forloop, nodes))
        symbols |= {a.symbol for a in grid} | ({forloop} if forloop else set())
    allowed = symbols | {NUM_TOKENS}
    inter = []
    for t in listed(data["intermediates"], 0, MAX_NODES, "sGraph JSON: 'intermediates'", E):
        fields(t, ("name", "shape", "dtype"), (), "sGraph JSON: intermediate", E)
        tname = name(t["name"], "intermediate name", E)
        shape = tuple(dim(d, allowed, f"intermediate '{tname}'")
                      for d in listed(t["shape"], 0, MAX_RANK, f"intermediate '{tname}' shape", E))
        inter.append(S.TensorDecl(tname, shape, one_of(t["dtype"], DTYPES, f"intermediate '{tname}' dtype", E)))
    try:
        return S.SGraph(gname, program, tuple(inter), tuple(kernels))
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise E(f"malformed sGraph '{gname}': {type(exc).__name__}: {str(exc)[:200]}") from None


def dim(value: Any, allowed: Collection[str], where: str):
    """One stored dim: an int, or a string of the dim grammar over the `allowed` symbols."""
    if type(value) is int:
        return D.parse_dim(str(int_in(value, 1, D.MAX_INT, f"{where} dim", SGraphError)), sym)
    if type(value) is not str:
        raise SGraphError(f"{where}: dim {show(value)} must be an int or a string")
    try:
        return D.parse_dim(value, sym, allowed)
    except SGraphError as exc:
        raise SGraphError(f"{where}: {exc}") from None


# --- kernel instances -------------------------------------------------------------------

MAX_PARAM = 2**20


def params_from_json(data: Any, where: str, error: type[PrismError]) -> dict[str, int]:
    """An instantiation: symbol -> positive int (at most MAX_PARAM)."""
    if isinstance(data, (str, bytes)):
        data = loads(data, error, f"{where} params")
    if not isinstance(data, dict) or len(data) > 16:
        raise error(f"{where}: params must be an object of at most 16 symbols, got {show(data)}")
    return {symbol(k, f"{where}: param name", error): int_in(v, 1, MAX_PARAM, f"{where}: param {k!r}", error)
            for k, v in data.items()}
