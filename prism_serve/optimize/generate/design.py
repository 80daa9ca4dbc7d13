"""A design: the generator's trace of operators, and the sGraph it builds for a Program.

A `Design` is a sequence of kernels. A `LibrarySpec` runs one IR op over kernel tensors. A
`BlockSpec` is a graph-defined kernel: its grid axes are index labels (`labels.py`), or joint
axes over labels that share no tensor (``q1.k1``, `axis_labels`), and its for-loop walks one
label; its block ops refer to the Program's constants as ``#name`` and to kernel tensors
through input iterators, each with its own imap and fmap:

- ``@name``: the tensor's own maps: the imap partitions, per grid axis, the tensor's dim with
  that axis' label, or replicates the tile where the tensor lacks it; the fmap is the dim with
  the loop label (`own_maps`);
- ``@name:whole``: the same imap, no fmap: every loop tile at once, loaded before the loop;
- ``@name:row``: the imap partitions the token dim only, replicating the tile over every other
  grid axis, and no fmap: the block's token rows, whole, for a statistic of rows whose columns
  the grid splits;
- ``@name:<imap>/<fmap>``: any other maps, one character per grid axis and one for the loop,
  each a dim of the tensor or ``-`` (replicated; not walked): ``@w:-0/-`` (`iterator_ref`). With
``split``, one more grid axis partitions the loop label (split-K / split-KV): see `split.py`.

`build(prog, design)` is pure and depends on the Program only through its node names, index
labels, dims and constants, so a design found for one Program of a family is replayed for
another one (shape-generic reuse of stored designs).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from prism_serve.errors import ProgramError, SGraphError
from prism_serve.optimize.ir import schema as T
from prism_serve.optimize.ir.labels import Labels, index_labels
from prism_serve.optimize.ir.ops import OPS, Kind, Op, of_kind, symbols
from prism_serve.optimize.ir.program import (ELEMENTWISE_BINARY, NUM_TOKENS, REDUCTIONS, TF32, Node, Program, TensorType,
                                             infer_type, is_tf32, node)
from prism_serve.optimize.ir.reference import expand_composites
from prism_serve.optimize.generate.axes import axis_labels, own_maps
from prism_serve.optimize.generate.windows import NO_INDEXING, Indexing, canonical, indexed_labels, indexing
from prism_serve.optimize.ir.sgraph import (ACCUM_KINDS, MAX_GRID_AXES, BlockKernel, GridAxis, Kernel, LibraryKernel,
                                            SGraph, TensorDecl, to_expr)

DESIGN_VERSION = 1
# the ops a design's kernels may run; unary in the generator's enumeration order: the function
# symbols of the algebras first, then the ops they expand (square)
UNARY = symbols() + tuple(op for op in of_kind(Kind.UNARY) if op not in symbols())
BINARY = of_kind(Kind.BINARY)
COMMUTATIVE = tuple(op for op in BINARY if OPS[op].commutative)
DESIGN_OPS = UNARY + BINARY + REDUCTIONS + of_kind(Kind.MATMUL) + of_kind(Kind.SLICE, Kind.GATHER, Kind.CONCAT)


@dataclass(frozen=True)
class BlockOp:
    name: str
    op: str  # an IR op, "accum" (attr kind) or "store" (attr tensor)
    inputs: tuple[str, ...]  # block op names, "@tensor" or "#const"
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str) -> Any:
        return dict(self.attrs)[key]


@dataclass(frozen=True)
class BlockSpec:
    grid: tuple[str, ...]  # one index label per grid axis, or a joint axis' labels (`joint_axis`)
    loop: str | None
    ops: tuple[BlockOp, ...]
    split: bool = False

    def describe(self) -> str:
        body = " ".join(_word(o) for o in self.ops)
        loop = f" {'split+' if self.split else ''}loop({self.loop})" if self.loop else ""
        return f"block grid({','.join(self.grid)}){loop}: {body}"


@dataclass(frozen=True)
class LibrarySpec:
    out: str
    op: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        return f"library {self.op}({','.join(self.inputs)})->{self.out}"


def _word(o: BlockOp) -> str:
    """A block op in a design's one-line description: its op, ``->tensor`` for a store,
    ``matmul.tf32`` for a matmul on TF32 operands."""
    if o.op == "store":
        return f"->{o.attr('tensor')}"
    return f"{o.op}.{TF32}" if is_tf32(o.attrs) else o.op


KernelSpec = BlockSpec | LibrarySpec


@dataclass(frozen=True)
class Design:
    kernels: tuple[KernelSpec, ...]

    def describe(self) -> str:
        return " | ".join(k.describe() for k in self.kernels)

    def to_json(self) -> dict:
        def op_json(o: BlockOp) -> dict:
            return {"name": o.name, "op": o.op, "inputs": list(o.inputs), "attrs": _attrs_json(o.attrs)}
        ks = []
        for k in self.kernels:
            if isinstance(k, LibrarySpec):
                ks.append({"kind": "library", "out": k.out, "op": k.op, "inputs": list(k.inputs),
                           "attrs": _attrs_json(k.attrs)})
            else:
                ks.append({"kind": "block", "grid": list(k.grid), "loop": k.loop, "split": k.split,
                           "ops": [op_json(o) for o in k.ops]})
        return {"design_version": DESIGN_VERSION, "kernels": ks}

    @staticmethod
    def from_json(data: Any) -> "Design":
        """Typed parsing of stored JSON (`design_from_json`): a design is untrusted data."""
        return design_from_json(data)


def _attrs_json(attrs) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs}


WHOLE = ":whole"
ROW = ":row"


def reads(spec: "KernelSpec") -> frozenset[str]:
    """The kernel tensors a kernel loads."""
    if isinstance(spec, LibrarySpec):
        return frozenset(spec.inputs)
    return frozenset(tensor_of(i)[0] for o in spec.ops for i in o.inputs if i.startswith("@"))


def writes(spec: "KernelSpec") -> frozenset[str]:
    """The kernel tensors a kernel stores."""
    if isinstance(spec, LibrarySpec):
        return frozenset((spec.out,))
    return frozenset(o.attr("tensor") for o in spec.ops if o.op == "store")


def intermediate_type(t: TensorType) -> TensorType:
    """A block kernel stores a tensor that only later kernels read in float32, whatever the
    Program's dtype: such a tensor is a partial result (a row's 1/rms, one projection of two), kept
    at the accumulators' precision as the hand-built designs keep it (an fp16 1/rms, or an fp16
    product of an unnormalised row, loses range and digits the reference keeps)."""
    return TensorType(t.shape, "float32")


_MAPS = re.compile(r":([0-9-]+)/([0-9-])")
Maps = tuple[tuple[int | None, ...], int | None]  # (imap, fmap) of an input iterator


def tensor_of(ref: str) -> tuple[str, str]:
    """The kernel tensor an ``@`` reference names, and its iterator's suffix ("" for its own maps)."""
    name = ref[1:]
    for suffix in (WHOLE, ROW):
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix
    m = _MAPS.search(name)
    if m and m.end() == len(name):
        return name[:m.start()], m.group(0)
    return name, ""


def iterator_maps(suffix: str, labels: tuple, grid: tuple[str, ...], loop: str | None) -> Maps:
    """The (imap, fmap) of the iterator `suffix` (`tensor_of`) over a tensor with `labels`.
    SGraphError where explicit maps do not fit the grid, the loop or the tensor's rank."""
    imap, fmap = own_maps(labels, grid, loop)
    if suffix == WHOLE:
        return imap, None
    if suffix == ROW:
        return tuple(d if lb == NUM_TOKENS else None for d, lb in zip(imap, grid)), None
    if not suffix:
        return imap, fmap
    m = _MAPS.fullmatch(suffix)
    if m is None or len(m.group(1)) != len(grid):
        raise SGraphError(f"iterator maps {suffix!r} do not fit a grid of {len(grid)} axes")
    dims = tuple(None if c == "-" else int(c) for c in m.group(1) + m.group(2))
    if any(d is not None and d >= len(labels) for d in dims) or (loop is None and dims[-1] is not None):
        raise SGraphError(f"iterator maps {suffix!r} do not fit a tensor of rank {len(labels)} "
                          f"{'and a for-loop' if loop else 'without a for-loop'}")
    return dims[:-1], dims[-1]


def iterator_ref(tensor_ref: str, maps: Maps, labels: tuple, grid: tuple[str, ...], loop: str | None) -> str:
    """The reference to kernel tensor `tensor_ref` (``@name``) read through `maps`: the shortest
    name of those maps (`tensor_of`)."""
    for suffix in ("", WHOLE, ROW):
        if iterator_maps(suffix, labels, grid, loop) == maps:
            return tensor_ref + suffix
    imap, fmap = maps
    return f"{tensor_ref}:{''.join('-' if d is None else str(d) for d in imap)}/{'-' if fmap is None else fmap}"


def read_labels(labels: tuple, grid: tuple[str, ...], loop: str | None, maps: Maps) -> tuple:
    """The index label at which an iterator reads each dim of a tensor: a dim that a grid axis
    partitions is read at that axis' label (at its own where it is one of a joint axis' labels),
    the dim the loop walks at the loop's label, any other at its own. Under the tensor's own maps
    these are its labels; a dim read at another label is a renamed (transposed, or mismatched)
    read."""
    imap, fmap = maps
    out = list(labels)
    for axis, d in zip(grid, imap):
        if d is not None:  # a joint axis reads each of its labels' dims at that label
            out[d] = labels[d] if labels[d] in axis_labels(axis) else axis
    if fmap is not None:
        out[fmap] = loop
    return tuple(out)


def ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def axis_symbol(label: str, k: int) -> str:
    return f"BT{k}" if label == NUM_TOKENS else f"G{k}_{ident(label)}"


@dataclass(frozen=True)
class KTensor:
    """A kernel tensor as the generator sees it: logical type and index labels."""

    name: str
    type: TensorType
    labels: tuple[str | None, ...]


def program_context(prog: Program) -> tuple[Program, Labels, dict[str, KTensor], dict[str, float]]:
    """The expanded Program, its labels, its input tensors and its constants."""
    flat = expand_composites(prog)
    labels = index_labels(flat)
    tensors = {n.name: KTensor(n.name, flat.types[n.name], labels.dims[n.name]) for n in flat.inputs}
    consts = {n.name: n.attr("value") for n in flat.nodes if n.op == "const"}
    for n in flat.nodes:  # a mean over a loop accumulates as a sum times 1/size
        if n.op == Op.MEAN:
            consts[f"inv.{labels.reduced[n.name][0]}"] = 1.0 / flat.types[n.inputs[0]].shape[n.attr("dim")]
    return flat, labels, tensors, consts


def block_types(spec: BlockSpec, tensors: dict[str, KTensor], indexing: Indexing = NO_INDEXING
                ) -> dict[str, tuple[TensorType, tuple]]:
    """Logical type and labels of every block op (raises ProgramError / SGraphError)."""
    out: dict[str, tuple[TensorType, tuple]] = {}
    for o in spec.ops:
        if o.op == "store":
            continue
        ins = [_operand(s, out, tensors, spec) for s in o.inputs]
        if o.op == "accum":
            out[o.name] = ins[0]
            continue
        n = Node(o.name, o.op, tuple(f"i{j}" for j in range(len(ins))), o.attrs)
        t = infer_type(n, [i[0] for i in ins])
        out[o.name] = (t, op_labels(o.op, dict(o.attrs), [i[1] for i in ins], indexing))
    return out


def _operand(s: str, local: dict, tensors: dict[str, KTensor], spec: BlockSpec):
    if s.startswith("@"):
        name, suffix = tensor_of(s)
        t = tensors[name]
        maps = iterator_maps(suffix, t.labels, spec.grid, spec.loop)
        return t.type, read_labels(t.labels, spec.grid, spec.loop, maps)
    if s.startswith("#"):
        return TensorType((), "const"), ()
    return local[s]


def op_labels(op: str, attrs: dict, ins: list[tuple], indexing: Indexing = NO_INDEXING) -> tuple:
    """Labels of an op's result from its operands' (the operands' labels must already agree; a
    slice or concat as the Program has it over those labels)."""
    if op in (Op.SLICE, Op.GATHER, Op.CONCAT):
        labels = indexed_labels(op, attrs, ins, indexing)
        if labels is None:
            raise SGraphError(f"no {op} of the Program reads labels {ins}")
        return labels
    if op in ELEMENTWISE_BINARY:
        a, b = ins
        return tuple(reversed([(a[-i] if i <= len(a) else None) or (b[-i] if i <= len(b) else None)
                               for i in range(1, max(len(a), len(b)) + 1)]))
    if op in REDUCTIONS:
        x, d = ins[0], attrs["dim"] % len(ins[0])
        return x[:d] + ((None,) if attrs["keepdim"] else ()) + x[d + 1:]
    if op == Op.MATMUL:
        a, b = ins
        bn = b[-2] if attrs["transpose_b"] else b[-1]
        batch = op_labels(Op.ADD, {}, [a[:-2], b[:-2]])
        return batch + (a[-2], bn)
    return ins[0]


def build(prog: Program, design: Design) -> SGraph:
    """The sGraph a design describes for `prog` (pure; raises SGraphError on a design that does
    not fit the Program)."""
    from prism_serve.optimize.generate.split import split_kernel

    flat, labels, tensors, consts = program_context(prog)
    windows = indexing(flat, labels)
    decls: list[TensorDecl] = []
    kernels: list[Kernel] = []
    try:
        for i, spec in enumerate(design.kernels):
            if isinstance(spec, LibrarySpec):
                n = node(spec.out, spec.op, *spec.inputs, **dict(spec.attrs))
                for s in spec.inputs:
                    if s not in tensors:
                        raise SGraphError(f"design kernel {i}: library op reads unknown tensor '{s}'")
                t = infer_type(n, [tensors[s].type for s in spec.inputs])
                ins = [tensors[s].labels for s in spec.inputs]
                tensors[spec.out] = KTensor(spec.out, t, op_labels(spec.op, dict(n.attrs), ins, windows))
                if spec.out not in flat.outputs:
                    decls.append(TensorDecl(spec.out, tuple(to_expr(d) for d in t.shape), t.dtype))
                kernels.append(LibraryKernel(n))
                continue
            _check_joint_axes(spec, i, labels)
            types = block_types(spec, tensors, windows)
            nodes = _block_nodes(spec, i, tensors, consts, types)
            for o in spec.ops:
                if o.op == "store" and o.attr("tensor") not in tensors:
                    t, lbs = types[o.inputs[0]]
                    if o.attr("tensor") not in flat.outputs:
                        t = intermediate_type(t)
                        decls.append(TensorDecl(o.attr("tensor"), tuple(to_expr(d) for d in t.shape), t.dtype))
                    tensors[o.attr("tensor")] = KTensor(o.attr("tensor"), t, lbs)
            grid = tuple(GridAxis(axis_symbol(lb, i), lb == NUM_TOKENS) for lb in spec.grid)
            k = BlockKernel(f"k{i}", grid, f"F{i}" if spec.loop else None, tuple(nodes))
            if spec.split:
                part_decls, ks = split_kernel(k, spec, i, tensors, types)
                decls += part_decls
                kernels += ks
            else:
                kernels.append(k)
    except (ProgramError, KeyError, IndexError, ValueError) as exc:
        raise SGraphError(f"design does not build for '{prog.name}': {type(exc).__name__}: {exc}") from None
    digest = hashlib.sha256(json.dumps(design.to_json(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return SGraph(f"{prog.name}_{digest}", prog, tuple(decls), tuple(kernels))


def _check_joint_axes(spec: BlockSpec, i: int, labels: Labels) -> None:
    """A joint grid axis joins distinct labels of the Program, not the tokens, no two of which one
    tensor holds (its blocks would split that tensor twice along one axis)."""
    known = {lb for dims in labels.dims.values() for lb in dims if lb}
    for axis in spec.grid:
        parts = axis_labels(axis)
        if len(parts) == 1:
            continue
        if len(set(parts)) != len(parts) or NUM_TOKENS in parts or not set(parts) <= known or any(
                len(set(parts) & set(dims)) > 1 for dims in labels.dims.values()):
            raise SGraphError(f"design kernel {i}: joint grid axis {axis!r} must join distinct labels of the "
                              f"Program, not {NUM_TOKENS}, that no tensor holds together")


def rebased(design: Design, source: Program, target: Program) -> Design:
    """`design`, found for `source`, with each slice's window replaced by `target`'s window for the
    same slice: of the windows that take one label to one label (cos and sin, the halves of the
    cache's dim, both become the label of the halves they multiply), the one in the same place in
    order. Programs of one family name their nodes alike, so their labels agree where their dims
    differ, and a rotary design found at head dim 128 (halves 0:64 and 64:128) rebuilds at 32
    (0:16 and 16:32). A window that `source` does not have, or that maps to several of `target`'s,
    is kept (the build then refuses it). The rebased design is proven and checked like any other."""
    def slices(prog: Program) -> dict[tuple, list]:
        flat, labels, _, _ = program_context(prog)
        out: dict[tuple, list] = {}
        for (lb, w), to in indexing(flat, labels).slices.items():
            out.setdefault((lb, to), []).append(w)
        return {k: sorted(ws) for k, ws in out.items()}

    at = slices(target)
    moves: dict[tuple, set] = {}
    for key, ws in slices(source).items():
        if len(at.get(key, ())) == len(ws):
            for w, to in zip(ws, at[key]):
                moves.setdefault(w, set()).add(to)
    windows = {w: next(iter(ws)) for w, ws in moves.items() if len(ws) == 1}

    def attrs(op: str, a: tuple) -> tuple:
        d = dict(a)
        if op != Op.SLICE:
            return a
        w = windows.get(canonical(d["start"], d["stop"], d["step"]))
        return a if w is None else tuple(sorted((d | dict(zip(("start", "stop", "step"), w))).items()))

    kernels = tuple(replace(k, attrs=attrs(k.op, k.attrs)) if isinstance(k, LibrarySpec) else
                    replace(k, ops=tuple(replace(o, attrs=attrs(o.op, o.attrs)) for o in k.ops))
                    for k in design.kernels)
    return Design(kernels)


def _block_nodes(spec: BlockSpec, i: int, tensors: dict[str, KTensor], consts: dict[str, float],
                 types: dict) -> list[Node]:
    loads: list[Node] = []
    body: list[Node] = []
    seen: set[str] = set()

    def ref(s: str) -> str:
        if s.startswith("@"):
            tensor, suffix = tensor_of(s)
            name = f"ld_{ident(tensor)}{ident(suffix.replace('-', 'r'))}"
            if name not in seen:
                t = tensors[tensor]
                imap, fmap = iterator_maps(suffix, t.labels, spec.grid, spec.loop)
                loads.append(node(name, "load", tensor=t.name, imap=imap, fmap=fmap))
                seen.add(name)
            return name
        if s.startswith("#"):
            name = f"c_{ident(s[1:])}"
            if name not in seen:
                loads.append(node(name, "const", value=consts[s[1:]]))
                seen.add(name)
            return name
        return s

    stage = stages(spec, tensors)
    for o in spec.ops:
        ins = tuple(ref(s) for s in o.inputs)
        if o.op == "store":
            t = tensors.get(o.attr("tensor")) or KTensor(o.attr("tensor"), *types[o.inputs[0]])
            lbs = types[o.inputs[0]][1]
            fmap = lbs.index(spec.loop) if stage[o.inputs[0]] == "loop" and spec.loop in lbs else None
            extra = {} if fmap is None else {"fmap": fmap}
            omap, _ = own_maps(t.labels, spec.grid, None)
            body.append(node(o.name, "store", *ins, tensor=o.attr("tensor"), omap=omap, **extra))
        else:
            body.append(Node(o.name, o.op, ins, o.attrs))
    return loads + body


def stages(spec: BlockSpec, tensors: dict[str, KTensor]) -> dict[str, str]:
    """'pre', 'loop' or 'post' per block op (as `BlockKernel.stages`, from the design)."""
    out: dict[str, str] = {}
    for o in spec.ops:
        if o.op == "accum":
            out[o.name] = "post"
            continue
        src = []
        for s in o.inputs:
            if s.startswith("@"):
                tensor, suffix = tensor_of(s)
                _, fmap = iterator_maps(suffix, tensors[tensor].labels, spec.grid, spec.loop)
                src.append("pre" if fmap is None else "loop")
            elif not s.startswith("#"):
                src.append(out[s])
        out[o.name] = "loop" if "loop" in src else "post" if "post" in src else "pre"
    return out


# --- the typed loader of stored designs ------------------------------------------------

REF = re.compile(rf"(@{T.NAME.pattern}(:whole|:row|:[0-9-]{{1,{MAX_GRID_AXES}}}/[0-9-])?|#{T.NAME.pattern}|{T.NAME.pattern})")
_DESIGN_ATTRS: dict[str, T.Check] = {"dim": T.DIM_ATTR, "keepdim": T.boolean, "transpose_b": T.boolean,
                                     "precision": T.OneOf((TF32,)), "kind": T.OneOf(ACCUM_KINDS), "tensor": T.name,
                                     **{k: T.ATTR_CHECKS[k] for k in ("start", "stop", "step", "interleave")}}
MAX_BLOCK_OPS = 64


def _design_attrs(raw: Any, where: str) -> tuple:
    E = SGraphError
    if not isinstance(raw, dict) or len(raw) > len(_DESIGN_ATTRS):
        raise E(f"{where}: attrs must be an object of known attributes, got {T.show(raw)}")
    for k in raw:
        if k not in _DESIGN_ATTRS:
            raise E(f"{where}: unknown attribute {T.show(k)}")
    return tuple(sorted((k, _DESIGN_ATTRS[k](v, f"{where}: {k}", E)) for k, v in raw.items()))


def _ref(value: Any, where: str) -> str:
    if type(value) is not str or not REF.fullmatch(value):
        raise SGraphError(f"{where} must be a block value, @tensor[:whole|:row|:<imap>/<fmap>] or #constant, got {T.show(value)}")
    return value


def design_from_json(data: Any) -> Design:
    """A stored generator design (warmup replays it for the new shapes; what it builds is then
    proven and checked like a searched one)."""
    E = SGraphError
    T.fields(data, ("design_version", "kernels"), (), "design JSON", E)
    if type(data["design_version"]) is not int or data["design_version"] != DESIGN_VERSION:
        raise E(f"design JSON has version {T.show(data['design_version'])}, expected {DESIGN_VERSION}")
    kernels = []
    for i, k in enumerate(T.listed(data["kernels"], 1, T.MAX_KERNELS, "design JSON: 'kernels'", E)):
        where = f"design JSON kernel {i}"
        kind = T.one_of(T.fields(k, ("kind",), ("out", "op", "inputs", "attrs", "grid", "loop", "split", "ops"),
                             where, E)["kind"], ("library", "block"), f"{where}: kind", E)
        if kind == "library":
            T.fields(k, ("kind", "out", "op", "inputs", "attrs"), (), where, E)
            kernels.append(LibrarySpec(
                T.name(k["out"], f"{where}: out", E), T.one_of(k["op"], DESIGN_OPS, f"{where}: op", E),
                tuple(T.name(x, f"{where}: input", E) for x in T.listed(k["inputs"], 1, T.MAX_INPUTS, f"{where}: inputs", E)),
                _design_attrs(k["attrs"], where)))
            continue
        T.fields(k, ("kind", "grid", "loop", "split", "ops"), (), where, E)
        block_ops = []
        for j, o in enumerate(T.listed(k["ops"], 1, MAX_BLOCK_OPS, f"{where}: ops", E)):
            at = f"{where} op {j}"
            T.fields(o, ("name", "op", "inputs", "attrs"), (), at, E)
            block_ops.append(BlockOp(
                T.name(o["name"], f"{at}: name", E), T.one_of(o["op"], DESIGN_OPS + ("accum", "store"), f"{at}: op", E),
                tuple(_ref(x, f"{at}: input") for x in T.listed(o["inputs"], 1, T.MAX_INPUTS, f"{at}: inputs", E)),
                _design_attrs(o["attrs"], at)))
        kernels.append(BlockSpec(
            tuple(T.name(g, f"{where}: grid label", E) for g in T.listed(k["grid"], 1, MAX_GRID_AXES, f"{where}: grid", E)),
            None if k["loop"] is None else T.name(k["loop"], f"{where}: loop label", E),
            tuple(block_ops), T.boolean(k["split"], f"{where}: split", E)))
    return Design(tuple(kernels))
