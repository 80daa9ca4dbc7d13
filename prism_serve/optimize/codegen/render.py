"""Triton code generation for an instantiated sGraph.

`render(instance)` produces one readable Python module: a ``@triton.jit``
kernel per block kernel and a launcher ``run(*inputs, out=None)`` that checks
shapes, allocates tensors, launches kernels and runs library ops in torch.
Tiles are padded to powers of two and masked; every reduction or matmul over
a padded dim masks its operand with the op's neutral element first, so
padding never leaks into results. Values are computed in fp32.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from types import ModuleType

from prism_serve.errors import CodegenError
from prism_serve.optimize.codegen.source import (TL_DTYPES, Value, expand, gpu_label, ident, label, lit, torch_dtype,
                                                 typed)
from prism_serve.optimize.codegen.windows import WindowedAccess
from prism_serve.optimize.ir.ops import OPS, Op
from prism_serve.optimize.ir.program import (ELEMENTWISE_BINARY, ELEMENTWISE_UNARY, INDEX_DTYPES, NUM_TOKENS,
                                             REDUCTIONS, Node, is_tf32)
from prism_serve.optimize.ir.sgraph import TOKENS, WINDOW_OPS, BlockKernel, LibraryKernel, launch_dims, sym, tile_shape
from prism_serve.optimize.target.instance import Instance
from prism_serve.optimize.target.resources import MMA_MIN, pow2

CODEGEN_VERSION = 3


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _lift(v: Value, rank: int) -> tuple[str, tuple[int, ...], tuple[str | None, ...]]:
    """Left-pad a value with unit dims up to `rank` (numpy broadcasting made explicit)."""
    pad = rank - len(v.dims)
    if pad == 0 or not v.dims:
        return v.var, (1,) * pad + v.dims, (None,) * pad + v.masks
    index = "[" + ", ".join(["None"] * pad + [":"] * len(v.dims)) + "]"
    return v.var + index, (1,) * pad + v.dims, (None,) * pad + v.masks


# float32 to TF32 (10 mantissa bits), to nearest with ties away from zero as cvt.rna.tf32.f32;
# infinities stay, a value that rounds past float32's largest becomes inf
ROUND_TF32 = ["@triton.jit", "def _round_tf32(x):", "    bits = x.to(tl.float32).to(tl.int32, bitcast=True)",
              "    return ((bits + 0x1000) & -0x2000).to(tl.float32, bitcast=True)"]


# float32 to bfloat16, to nearest with ties to even as the GPU's cvt.rn.bf16.f32 (and torch) round,
# as a float32: Triton's CPU interpreter truncates instead (toward zero: every rounding biased by
# -2^-9 on average, which doubled a bf16 attention kernel's error against torch's), so in interpret
# mode the kernel rounds with this first, and the interpreter's cast of the result is then exact
ROUND_BF16 = ["@triton.jit", "def _round_bf16(x):", "    bits = x.to(tl.float32).to(tl.int32, bitcast=True)",
              "    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)"]


class _KernelWriter(WindowedAccess):
    """Emits one @triton.jit kernel for a block kernel of an instance."""

    def __init__(self, inst: Instance, k: BlockKernel, dot_dtype: str, half: str | None = None,
                 interpret: bool = False):
        self.inst, self.k, self.dot_dtype, self.half, self.interpret = inst, k, dot_dtype, half, interpret
        self.g = inst.sgraph
        self.lines: list[str] = []
        self.masks: dict[str, str] = {}  # mask expression -> variable
        self.values: dict[str, Value] = {}
        self.tensors = list(dict.fromkeys(n.attr("tensor") for n in k.nodes if n.op in ("load", "store")))
        self.uses_tokens = any(TOKENS in d.free_symbols for t in self.tensors for d in self.g.tensors[t].shape)
        # Token tiles below the MMA minimum are padded to 16 masked rows where the resource
        # model says so, so that their matmuls run as tl.dot on tensor cores.
        self.padded_token = next((a.symbol for a in k.grid if a.over_tokens), None) \
            if inst.resources(k).mma_padded else None
        # loads, slices and gathers read only as windows by slices and gathers: rendered inside them
        uses: dict[str, list[tuple[Node, int]]] = {}
        for n in k.nodes:
            for i, src in enumerate(n.inputs):
                uses.setdefault(src, []).append((n, i))
        self.windowed = {name for name, us in uses.items() if k.by_name[name].op in WINDOW_OPS and
                         all(c.op == Op.SLICE or (c.op == Op.GATHER and i == 0) for c, i in us)}

    # --- helpers ---------------------------------------------------------
    def emit(self, line: str, depth: int) -> None:
        self.lines.append("    " * depth + line)

    def params(self) -> list[str]:
        out = []
        for t in self.tensors:
            out.append(f"{ident(t)[2:]}_ptr")
            out += [f"{ident(t)[2:]}_s{d}" for d in range(len(self.g.tensors[t].shape))]
        return out + (["n_tokens"] if self.uses_tokens else [])

    def _tiling(self, n: Node, masks: bool = True) -> list[tuple[int, str, str | None, bool]]:
        """Per dim of a load/store: (tile, start expression, mask variable, loop-dependent); with
        `masks` False, each mask's expression instead (nothing registered: a window's load)."""
        t = n.attr("tensor")
        shape = self.g.tensors[t].shape
        imap = n.attr("imap") if n.op == "load" else n.attr("omap")
        fmap = dict(n.attrs).get("fmap")
        tile = self.inst.tile(self.k, n.name) if n.op == "load" else self._store_tile(n)
        token_dims = [d == sym(self.padded_token) for d in
                      (self.g.block_types(self.k)[n.name].shape if n.op == "load" else
                       tile_shape(self.k, shape, imap, fmap))] if self.padded_token else [False] * len(shape)
        out = []
        for d, size in enumerate(shape):
            starts, loop_dep = [], False
            for a, (axis, dim) in enumerate(zip(self.k.grid, imap)):
                if dim == d:
                    per_block = tile[d] if axis.over_tokens else self.inst.concrete(size) // self.inst.values[axis.symbol]
                    starts.append(f"pid{a} * {per_block}")
            if fmap == d:
                starts.append(f"it * {tile[d]}")
                loop_dep = True
            extent = max(pow2(tile[d]), MMA_MIN) if token_dims[d] else pow2(tile[d])
            conds = []
            if extent != tile[d]:
                conds.append(f"tl.arange(0, {extent}) < {tile[d]}")
            if size == TOKENS:
                conds.append(f"({' + '.join(starts) or '0'} + tl.arange(0, {extent})) < n_tokens")
            cond = " & ".join(f"({c})" for c in conds)
            out.append((extent if token_dims[d] else tile[d], " + ".join(starts),
                        self._mask(cond) if masks else cond, loop_dep))
        return out

    def _store_tile(self, n: Node) -> tuple[int, ...]:
        decl = self.g.tensors[n.attr("tensor")]
        return tuple(self.inst.concrete(d) for d in tile_shape(self.k, decl.shape, n.attr("omap"),
                                                               dict(n.attrs).get("fmap")))

    def _mask(self, expr: str) -> str | None:
        if not expr:
            return None
        if expr not in self.masks:
            self.masks[expr] = f"mask{len(self.masks)}"
        return self.masks[expr]

    def _pointers(self, n: Node, tiling, depth: int) -> tuple[str, str | None]:
        t, rank = n.attr("tensor"), len(tiling)
        terms, masks = [], []
        for d, (tile, start, mask, _) in enumerate(tiling):
            offs = f"offs_{ident(n.name)[2:]}_{d}"
            self.emit(f"{offs} = {start + ' + ' if start else ''}tl.arange(0, {pow2(tile)})", depth)
            terms.append(f"{expand(offs, d, rank)} * {ident(t)[2:]}_s{d}")
            if mask:
                masks.append(expand(mask, d, rank))
        return f"{ident(t)[2:]}_ptr + " + " + ".join(terms), " & ".join(masks) or None

    # --- ops ---------------------------------------------------------------
    def load(self, n: Node, depth: int) -> None:
        tiling = self._tiling(n)
        ptrs, mask = self._pointers(n, tiling, depth)
        var = ident(n.name)
        if self.g.tensors[n.attr("tensor")].dtype in INDEX_DTYPES:  # an index tile stays integer; masked rows pick row 0
            self.emit(f"{var} = tl.load({ptrs}{f', mask={mask}, other=0' if mask else ''})", depth)
        else:
            masked = f", mask={mask}, other=0.0" if mask else ""
            self.emit(f"{var} = tl.load({ptrs}{masked}).to(tl.float32)", depth)
        self.values[n.name] = Value(var, tuple(t for t, *_ in tiling), tuple(m for _, _, m, _ in tiling))

    def store(self, n: Node, depth: int) -> None:
        if self.k.by_name[n.inputs[0]].op == Op.CONCAT:
            self.store_parts(n, depth)
            return
        v = self.values[n.inputs[0]]
        tiling = self._tiling(n)
        ptrs, mask = self._pointers(n, tiling, depth)
        dims = tuple(pow2(t) for t, *_ in tiling)
        val = v.var if v.padded == dims else f"tl.reshape({v.var}, {dims})"
        self._store_line(n, ptrs, val, mask, depth)

    def _store_line(self, n: Node, ptrs: str, val: str, mask: str | None, depth: int) -> None:
        masked = f", mask={mask}" if mask else ""
        if self.interpret and self.g.tensors[n.attr("tensor")].dtype == "bfloat16":
            val = f"_round_bf16({val})"  # see ROUND_BF16
        # replicas agree: along a grid axis the store does not map, only the first block writes
        first = [f"pid{a} == 0" for a, d in enumerate(n.attr("omap")) if d is None]
        if first:
            self.emit(f"if {' and '.join(first)}:", depth)
        self.emit(f"tl.store({ptrs}, {val}.to({ident(n.attr('tensor'))[2:]}_ptr.dtype.element_ty){masked})",
                  depth + bool(first))

    def _to_half(self, x: str) -> str:
        """`x` rounded to the kernel's half dtype, as a float32 value (rounded as the GPU rounds)."""
        if self.interpret and self.half == TL_DTYPES["bfloat16"]:
            return f"_round_bf16({x})"
        return f"{x}.to({self.half}).to(tl.float32)"

    def _masked(self, v: Value, dim: int, neutral: str) -> str:
        if v.masks[dim] is None:
            return v.var
        return f"tl.where({expand(v.masks[dim], dim, len(v.dims))}, {v.var}, {neutral})"

    def compute(self, n: Node, depth: int) -> None:
        var, op = ident(n.name), n.op
        srcs = [self.values[s] for s in n.inputs]
        if op == "const":
            self.values[n.name] = Value(lit(typed(n.attr("value"), float)), (), ())
            return
        if op in ELEMENTWISE_BINARY:
            rank = max(len(s.dims) for s in srcs)
            (a, ad, am), (b, bd, bm) = _lift(srcs[0], rank), _lift(srcs[1], rank)
            if not srcs[0].dims:
                ad, am = bd, bm
            if not srcs[1].dims:
                bd, bm = ad, am
            dims = tuple(max(x, y) for x, y in zip(ad, bd))
            masks = tuple(ma if x != 1 else mb for x, ma, mb in zip(ad, am, bm))
            self.emit(f"{var} = {OPS[op].triton.format(a, b)}", depth)
            self.values[n.name] = Value(var, dims, masks)
        elif op in ELEMENTWISE_UNARY:
            self.emit(f"{var} = {OPS[op].triton.format(srcs[0].var)}", depth)
            self.values[n.name] = Value(var, srcs[0].dims, srcs[0].masks)
        elif op in REDUCTIONS:
            v, dim, keep = srcs[0], typed(n.attr("dim"), int) % len(srcs[0].dims), typed(n.attr("keepdim"), bool)
            x = self._masked(v, dim, 'float("-inf")' if op == Op.MAX else "0.0")
            fn = "tl.max" if op == Op.MAX else "tl.sum"
            scale = f" * {1.0 / v.dims[dim]!r}" if op == Op.MEAN else ""
            self.emit(f"{var} = {fn}({x}, axis={dim}, keep_dims={lit(keep)}){scale}", depth)
            dims = v.dims[:dim] + ((1,) if keep else ()) + v.dims[dim + 1:]
            masks = v.masks[:dim] + ((None,) if keep else ()) + v.masks[dim + 1:]
            self.values[n.name] = Value(var, dims, masks)
        elif op == Op.MATMUL:
            self.matmul(n, srcs[0], srcs[1], depth)
        else:
            raise CodegenError(f"kernel '{self.k.name}': op {op!r} has no Triton rendering")

    def matmul(self, n: Node, a: Value, b: Value, depth: int) -> None:
        var, tb = ident(n.name), typed(n.attr("transpose_b"), bool)
        if any(d != 1 for d in a.dims[:-2] + b.dims[:-2]):
            raise CodegenError(f"kernel '{self.k.name}' node '{n.name}': batched tiles are not supported; "
                               f"map the batch dims to the grid")
        kb = -1 if tb else -2
        kmask = a.masks[-1] or b.masks[kb]
        a2 = self._masked(Value(a.var, a.dims, a.masks[:-1] + (kmask,)), len(a.dims) - 1, "0.0")
        b2 = self._masked(Value(b.var, b.dims, b.masks[:kb] + (kmask,) + b.masks[kb:][1:]),
                          len(b.dims) + kb, "0.0")
        (m, kk), (bk, bn) = a.padded[-2:], b.padded[-2:]
        if len(a.dims) > 2:
            a2 = f"tl.reshape({a2}, ({m}, {kk}))"
        if len(b.dims) > 2:
            b2 = f"tl.reshape({b2}, ({bk}, {bn}))"
        if tb:
            b2 = f"tl.trans({b2})"
        nn = bk if tb else bn
        tf32 = is_tf32(n.attrs)
        if min(m, kk, nn) >= MMA_MIN and tf32 and not self.interpret:
            expr = f'tl.dot({a2}.to(tl.float32), {b2}.to(tl.float32), input_precision="tf32")'
        elif min(m, kk, nn) >= MMA_MIN and not tf32 and self.dot_dtype != "tl.float32":
            expr = f"tl.dot({a2}.to({self.dot_dtype}), {b2}.to({self.dot_dtype}))"
        else:
            # operands rounded as tl.dot takes them (to TF32 as the GPU's cvt.rna.tf32.f32 does, or to
            # the kernel's half dtype), whatever the tile: a design's range and precision do not
            # depend on its instance, and the interpreter (whose tl.dot ignores TF32) sees the GPU's
            if tf32:
                a2, b2 = f"_round_tf32({a2})", f"_round_tf32({b2})"
            elif self.half:
                a2, b2 = self._to_half(a2), self._to_half(b2)
            if min(m, kk, nn) >= MMA_MIN:
                expr = f'tl.dot({a2}, {b2}, input_precision="ieee")'
            else:
                expr = f"tl.sum(({a2})[:, :, None] * ({b2})[None, :, :], axis=1)"
        rank = max(len(a.dims), len(b.dims))
        ndim = b.dims[-2] if tb else b.dims[-1]
        nmask = b.masks[-2] if tb else b.masks[-1]
        dims = (1,) * (rank - 2) + (a.dims[-2], ndim)
        if rank > 2:
            expr = f"tl.reshape({expr}, {tuple(pow2(d) for d in dims)})"
        self.emit(f"{var} = {expr}", depth)
        self.values[n.name] = Value(var, dims, (None,) * (rank - 2) + (a.masks[-2], nmask))

    def accum_init(self, n: Node, depth: int) -> None:
        shape = tuple(max(pow2(self.inst.concrete(d)), MMA_MIN) if self.padded_token and d == sym(self.padded_token)
                      else pow2(self.inst.concrete(d)) for d in self.g.block_types(self.k)[n.name].shape)
        init = 'float("-inf")' if n.attr("kind") == Op.MAX else "0.0"
        self.emit(f"{ident(n.name)} = tl.full({shape}, {init}, tl.float32)", depth)

    def accum_step(self, n: Node, depth: int) -> None:
        acc, x, kind = ident(n.name), self.values[n.inputs[0]], n.attr("kind")
        if kind == Op.MAX:
            self.emit(f"{acc}_prev = {acc}", depth)
            self.emit(f"{acc} = tl.maximum({acc}, {x.var})", depth)
        elif kind == "rescaled_sum":
            m = ident(n.inputs[1])
            self.emit(f"{acc} = {acc} * tl.exp({m}_prev - {m}) + {x.var}", depth)
        else:
            self.emit(f"{acc} = {acc} + {x.var}", depth)
        self.values[n.name] = Value(acc, x.dims, x.masks)

    def write(self) -> list[str]:
        k, stages = self.k, self.k.stages
        body_start = len(self.lines)
        for i, dims in enumerate(launch_dims(len(k.grid))):
            for j, a in enumerate(dims):  # folded axes: row-major in one launch dim
                inner = math.prod(self.inst.values[k.grid[b].symbol] for b in dims[j + 1:])
                pid = f"tl.program_id({i})" + (f" // {lit(inner)}" if inner > 1 else "")
                self.emit(f"pid{a} = {pid}" + (f" % {lit(self.inst.values[k.grid[a].symbol])}" if len(dims) > 1 else ""),
                          1)
        for phase in ("pre", "loop", "post"):
            depth = 2 if phase == "loop" else 1
            if phase == "loop" and k.forloop:
                for n in k.nodes:
                    if n.op == "accum":
                        self.accum_init(n, 1)
                self.emit(f"for it in range(0, {lit(self.inst.values[k.forloop])}):", 1)
            for n in k.nodes:
                stage = stages[n.name]
                if n.op == "accum":
                    if phase == "loop":
                        self.accum_step(n, depth)
                    elif phase == "post" and n.attr("kind") == Op.MEAN:
                        self.emit(f"{ident(n.name)} = {ident(n.name)} * {1.0 / self.inst.values[k.forloop]!r}", 1)
                    continue
                if stage != phase:
                    continue
                if n.name in self.windowed or n.op == Op.CONCAT:  # rendered by their readers / their stores
                    continue
                if n.op == "load":
                    self.load(n, depth)
                elif n.op == "store":
                    self.store(n, depth)
                elif n.op in (Op.SLICE, Op.GATHER):
                    self.read(n, depth)
                else:
                    self.compute(n, depth)
        masks = [f"    {var} = {expr}" for expr, var in self.masks.items()]
        body = self.lines[body_start:]
        grid = ", ".join(f"{label(a.symbol)}={lit(self.inst.values[a.symbol])}" for a in k.grid)
        loop = f", loop {label(k.forloop)}={lit(self.inst.values[k.forloop])}" if k.forloop else ""
        header = ["@triton.jit", f"def {self.kname}({', '.join(self.params())}):",
                  f"    # grid ({grid}){loop}"]
        return header + body[:len(k.grid)] + masks + body[len(k.grid):]

    @property
    def kname(self) -> str:
        return f"{ident(self.g.name)[2:]}_{ident(self.k.name)[2:]}"


def _library_line(op: Node, rank: int) -> str:
    """The torch line of a library kernel; `rank`: its first operand's."""
    x = [ident(s) for s in op.inputs]
    out = ident(op.name)
    if op.op in (Op.GATHER, Op.SLICE, Op.CONCAT):
        d = typed(op.attr("dim"), int) % rank
        if op.op == Op.GATHER:
            return f"{out} = {x[0]}.index_select({d}, {x[1]}.reshape(-1)).reshape(" \
                   f"{x[0]}.shape[:{d}] + {x[1]}.shape + {x[0]}.shape[{d + 1}:])"
        if op.op == Op.SLICE:
            window = ":".join(lit(typed(op.attr(key), int)) for key in ("start", "stop", "step"))
            return f"{out} = {x[0]}[{':, ' * d}{window}]"
        if typed(op.attr("interleave"), bool):
            return f"{out} = torch.stack(({x[0]}, {x[1]}), {d + 1}).flatten({d}, {d + 1})"
        return f"{out} = torch.cat(({x[0]}, {x[1]}), {d})"
    if op.op in ELEMENTWISE_BINARY + ELEMENTWISE_UNARY:
        return f"{out} = {OPS[op.op].torch_source.format(*x)}"
    if op.op in REDUCTIONS:
        return f"{out} = {OPS[op.op].torch_source}({x[0]}, dim={lit(typed(op.attr('dim'), int))}, " \
               f"keepdim={lit(typed(op.attr('keepdim'), bool))})"
    if op.op == Op.MATMUL:
        b = f"{x[1]}.transpose(-1, -2)" if typed(op.attr("transpose_b"), bool) else x[1]
        return f"{out} = torch.matmul({x[0]}, {b})"
    if op.op == Op.RMS_NORM:
        w = x[1] if len(x) > 1 else "None"
        return f"{out} = torch.nn.functional.rms_norm({x[0]}, ({x[0]}.shape[-1],), {w}, {lit(typed(op.attr('eps'), float))})"
    raise CodegenError(f"library op {op.op!r} has no torch rendering")


def render(inst: Instance, *, interpret: bool | None = None) -> str:
    """The whole generated module for `inst` as Python source."""
    interpret = interpreting() if interpret is None else interpret
    g = inst.sgraph
    prog = g.program
    dtypes = {n.attr("dtype") for n in prog.inputs}
    half = next((d for d in ("float16", "bfloat16") if d in dtypes), None)
    # The interpreter multiplies bf16 operands of tl.dot wrongly: keep those fp32 there. fp16 operands
    # stay fp16 (the interpreter gets them right), so the CPU check sees the GPU's range (overflow).
    dot_dtype = TL_DTYPES[half] if half and not (interpret and half == "bfloat16") else "tl.float32"
    values = ", ".join(f"{label(k)}={lit(v)}" for k, v in inst.assignment)
    out = [f'"""Generated by prism-serve codegen v{CODEGEN_VERSION} for sGraph {label(g.name)!r} '
           f'(program {prog.canonical_hash}) on {gpu_label(inst.gpu)}: {values}."""',
           "import torch", "import triton", "import triton.language as tl", ""]
    writers, kernels = {}, []
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            w = _KernelWriter(inst, k, dot_dtype, TL_DTYPES[half] if half else None, interpret)
            kernels += w.write() + ["", ""]
            writers[k.name] = w
    for name, helper in (("_round_tf32(", ROUND_TF32), ("_round_bf16(", ROUND_BF16)):
        if any(name in line for line in kernels):
            out += helper + ["", ""]
    out += kernels
    token_inputs = [(n.name, n.attr("shape").index(NUM_TOKENS)) for n in prog.inputs if NUM_TOKENS in n.attr("shape")]
    args = ", ".join(ident(n.name) for n in prog.inputs)
    out.append(f"def run({args}, *, out=None):")
    out.append(f'    """Compute {", ".join(map(label, prog.outputs))} of {label(prog.name)!r}; '
               f'`out` may give preallocated outputs."""')
    if token_inputs:
        name, dim = token_inputs[0]
        out.append(f"    n_tokens = {ident(name)}.shape[{dim}]")
    else:
        out.append("    n_tokens = 0")
    for n in prog.inputs:
        shape = ", ".join("n_tokens" if d == NUM_TOKENS else lit(typed(d, int)) for d in n.attr("shape"))
        out.append(f"    if tuple({ident(n.name)}.shape) != ({shape},):")
        out.append(f"        raise ValueError(f\"input {label(n.name)!r}: expected shape ({shape},), "
                   f"got {{tuple({ident(n.name)}.shape)}}\")")
    device = ident(prog.inputs[0].name) + ".device"
    for i, o in enumerate(prog.outputs):
        shape = _shape_code(inst, o)
        dt = torch_dtype(g.tensors[o].dtype)
        if any(isinstance(k, BlockKernel) and o in (s.attr("tensor") for s in k.stores) for k in g.kernels):
            out.append(f"    {ident(o)} = out[{i}] if out is not None else torch.empty({shape}, dtype={dt}, "
                       f"device={device})")
    for t in g.intermediates:
        if any(isinstance(k, BlockKernel) and t.name in (s.attr("tensor") for s in k.stores) for k in g.kernels):
            out.append(f"    {ident(t.name)} = torch.empty({_shape_code(inst, t.name)}, "
                       f"dtype={torch_dtype(t.dtype)}, device={device})")
    for k in g.kernels:
        if isinstance(k, LibraryKernel):
            out.append("    " + _library_line(k.op, len(g.tensors[k.op.inputs[0]].shape) if k.op.inputs else 0))
            if k.op.name in prog.outputs:
                i = prog.outputs.index(k.op.name)
                out.append("    if out is not None:")
                out.append(f"        {ident(k.op.name)} = out[{i}].copy_({ident(k.op.name)})")
            continue
        w = writers[k.name]
        extent = [f"triton.cdiv(n_tokens, {lit(inst.values[a.symbol])})" if a.over_tokens
                  else lit(inst.values[a.symbol]) for a in k.grid]
        grid = ", ".join(" * ".join(extent[a] for a in dims) for dims in launch_dims(len(k.grid)))
        call = []
        for t in w.tensors:
            call.append(ident(t))
            call += [f"{ident(t)}.stride({d})" for d in range(len(g.tensors[t].shape))]
        if w.uses_tokens:
            call.append("n_tokens")
        call.append(f"num_warps={inst.warps(k)}")
        launch = f"{w.kname}[({grid},)]({', '.join(call)})"
        if any(a.over_tokens for a in k.grid):  # no blocks for no tokens; later library ops still run
            out += ["    if n_tokens > 0:", f"        {launch}"]
        else:
            out.append(f"    {launch}")
    out.append(f"    return {_outputs_tuple(prog.outputs)}")
    return "\n".join(out) + "\n"


def _outputs_tuple(outputs) -> str:
    return "(" + ", ".join(ident(o) for o in outputs) + ",)"


def _shape_code(inst: Instance, name: str) -> str:
    dims = []
    for d in inst.sgraph.tensors[name].shape:
        dims.append("n_tokens" if d == TOKENS else str(inst.concrete(d)))
    return "(" + ", ".join(dims) + ",)"


_MODULES: dict[str, ModuleType] = {}  # by source digest, the most recently loaded last
_MODULES_MAX = 256  # a module dropped is loaded again from its file alike


def load(source: str) -> ModuleType:
    """Import generated source from the per-user kernel cache (Triton needs a real file)."""
    from prism_serve.paths import cache_dir
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    if digest in _MODULES:
        _MODULES[digest] = _MODULES.pop(digest)
        return _MODULES[digest]
    folder = cache_dir() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"k_{digest}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"prism_kernel_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a generated module that fails to import is a codegen bug
        raise CodegenError(f"generated kernel module {path} failed to load: {exc}") from exc
    if len(_MODULES) >= _MODULES_MAX:
        del _MODULES[next(iter(_MODULES))]
    _MODULES[digest] = module
    return module


def compile_instance(inst: Instance, *, interpret: bool | None = None):
    """The `run` launcher of the instance's generated module."""
    return load(render(inst, interpret=interpret)).run
