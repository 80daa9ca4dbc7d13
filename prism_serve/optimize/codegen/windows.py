"""Rendering of slice, gather and concat in a block kernel, placed as `ir/sgraph.py` requires.

A slice or gather reads a *window* of one load's tensor (`_Window`): per dim, a strided range of
a tensor dim, or a dim of the gather's integer index tile; it becomes one `tl.load` (windowed,
strided, or indexed: the index times the gathered dim's stride), and the load under it is never
materialised where only windows read it. A store of a (nested) concat becomes one store per part
at its offset along the joined dims (strided where interleaved): no concat in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prism_serve.optimize.codegen.source import Value, expand, ident, typed
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import Node
from prism_serve.optimize.target.resources import pow2


@dataclass(frozen=True)
class _Axis:
    """A dim of a window: elements start + step * i (i < size) of tensor dim `tdim`, past the
    load's own tile start; `sliced` where a slice chose them (else the load's tile and mask)."""

    tdim: int
    start: int = 0
    step: int = 1
    size: int = 1
    sliced: bool = False


@dataclass(frozen=True)
class _Window:
    """What a load, slice or gather reads: its load, per dim an `_Axis` or (an int) the dim of the
    gather's index tile that dim runs over, and that index and the tensor dim it picks."""

    load: Node
    axes: tuple[_Axis | int, ...]
    index: str | None = None
    gathered: int | None = None


def _place(var: str, at: int, width: int, rank: int) -> str:
    """A tile of `width` dims placed at dims at .. at + width - 1 of a rank-`rank` tile."""
    if width == rank:
        return var
    return var + "[" + ", ".join(["None"] * at + [":"] * width + ["None"] * (rank - at - width)) + "]"


class WindowedAccess:
    """The window methods of a kernel writer (`render._KernelWriter`), which provides `k`, `g`,
    `inst`, `values`, `emit`, `_mask`, `_tiling` and `_store_line`."""

    def _window(self, name: str) -> _Window:
        n = self.k.by_name[name]
        if n.op == "load":
            return _Window(n, tuple(_Axis(d, size=tile) for d, (tile, *_) in enumerate(self._tiling(n, False))))
        w = self._window(n.inputs[0])
        d = typed(n.attr("dim"), int) % len(w.axes)
        a = w.axes[d]
        if n.op == Op.SLICE:
            start, stop, step = (typed(n.attr(key), int) for key in ("start", "stop", "step"))
            cut = _Axis(a.tdim, a.start + a.step * start, a.step * step, -(-(stop - start) // step), True)
            return _Window(w.load, w.axes[:d] + (cut,) + w.axes[d + 1:], w.index, w.gathered)
        index = self.values[n.inputs[1]]
        return _Window(w.load, w.axes[:d] + tuple(range(len(index.dims))) + w.axes[d + 1:], n.inputs[1], a.tdim)

    def read(self, n: Node, depth: int) -> None:
        """A slice or gather as one load of its window: a windowed / strided load of the tensor,
        or an indexed one (the index tile's rows times the gathered dim's stride)."""
        w = self._window(n.name)
        tiling, rank, tensor = self._tiling(w.load, False), len(w.axes), ident(w.load.attr("tensor"))[2:]
        index = self.values[w.index] if w.index else None
        terms, masks, dims, dim_masks = [], [], [], []
        for p, a in enumerate(w.axes):
            if isinstance(a, int):  # a dim of the index tile
                if a == 0:
                    terms.append(f"{_place(index.var, p, len(index.dims), rank)}.to(tl.int64) * {tensor}_s{w.gathered}")
                dims.append(index.dims[a])
                dim_masks.append(index.masks[a])
            else:
                _, start, cond, _ = tiling[a.tdim]
                offs = f"offs_{ident(n.name)[2:]}_{p}"
                steps = f"{a.step} * tl.arange(0, {pow2(a.size)})" if a.step != 1 else f"tl.arange(0, {pow2(a.size)})"
                first = " + ".join(x for x in (start, str(a.start) if a.start else "") if x)
                self.emit(f"{offs} = {first + ' + ' if first else ''}{steps}", depth)
                terms.append(f"{expand(offs, p, rank)} * {tensor}_s{a.tdim}")
                if a.sliced:  # the load's dim is whole (sgraph's placement rule): only the window pads
                    cond = f"(tl.arange(0, {pow2(a.size)}) < {a.size})" if pow2(a.size) != a.size else ""
                mask = self._mask(cond)
                dims.append(a.size)
                dim_masks.append(mask)
            if dim_masks[-1]:
                masks.append(expand(dim_masks[-1], p, rank))
        var = ident(n.name)
        masked = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        self.emit(f"{var} = tl.load({tensor}_ptr + {' + '.join(terms)}{masked}).to(tl.float32)", depth)
        self.values[n.name] = Value(var, tuple(dims), tuple(dim_masks))

    def _parts(self, name: str, at: dict[int, tuple[int, int]]) -> list[tuple[str, dict[int, tuple[int, int]]]]:
        """The parts of a (nested) concat, each with its (offset, step) along the dims it was joined on."""
        n = self.k.by_name[name]
        if n.op != Op.CONCAT:
            return [(name, at)]
        a, b = n.inputs
        shape = self.g.block_types(self.k)[a].shape
        d = typed(n.attr("dim"), int) % len(shape)
        off, step = at.get(d, (0, 1))
        if typed(n.attr("interleave"), bool):
            where_a, where_b = (off, 2 * step), (off + step, 2 * step)
        else:
            where_a, where_b = (off, step), (off + step * self.inst.concrete(shape[d]), step)
        return self._parts(a, at | {d: where_a}) + self._parts(b, at | {d: where_b})

    def store_parts(self, n: Node, depth: int) -> None:
        """A store of a concat: one store per part, at its offset (strided where interleaved)."""
        tiling = self._tiling(n, False)
        rank = len(tiling)
        for part, at in self._parts(n.inputs[0], {}):
            v = self.values[part]
            terms, masks, dims = [], [], []
            for d, (tile, start, cond, _) in enumerate(tiling):
                size = v.dims[d] if d in at else tile
                off, step = at.get(d, (0, 1))
                steps = f"{step} * tl.arange(0, {pow2(size)})" if step != 1 else f"tl.arange(0, {pow2(size)})"
                first = " + ".join(x for x in (start, str(off) if off else "") if x)
                offs = f"offs_{ident(n.name)[2:]}_{ident(part)[2:]}_{d}"
                self.emit(f"{offs} = {first + ' + ' if first else ''}{steps}", depth)
                terms.append(f"{expand(offs, d, rank)} * {ident(n.attr('tensor'))[2:]}_s{d}")
                if d in at:  # a dim the store leaves whole (sgraph's placement rule): only the part pads
                    cond = f"(tl.arange(0, {pow2(size)}) < {size})" if pow2(size) != size else ""
                mask = self._mask(cond)
                if mask:
                    masks.append(expand(mask, d, rank))
                dims.append(pow2(size))
            val = v.var if v.padded == tuple(dims) else f"tl.reshape({v.var}, {tuple(dims)})"
            self._store_line(n, f"{ident(n.attr('tensor'))[2:]}_ptr + " + " + ".join(terms), val,
                             " & ".join(masks) or None, depth)
