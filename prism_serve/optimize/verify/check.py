"""The numeric second line of verification: run generated Triton against the torch reference at
a small instantiation, on fresh random inputs and on adversarial ones in the kernel's dtype
(`check_numerics`): a design that is exact in real arithmetic can still overflow in fp16."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy
import torch

from prism_serve.errors import SGraphError
from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import INDEX_DTYPES, NUM_TOKENS, Node, Program, node
from prism_serve.optimize.ir.reference import (TOLERANCE, TORCH_DTYPES, evaluate, fresh_seed, index_bounds,
                                               max_rel_error, random_inputs)
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import Instance, instantiate

SMALL_DIM = 48  # not a power of two, so padding and masks are exercised
# An index input's dims besides tokens (MoE's top-k choices) are cut further: each choice is a
# block of its own in the designs that split them, an interpreted block (the two-kernel design's
# check at Qwen3-30B-A3B's 8 choices took 64 s, at 2 it takes 16 s). Two still sum.
SMALL_INDEX_DIM = 2


def _placed_sizes(prog: Program) -> set[int]:
    """The sizes of the dims that a slice cuts or a concat joins: their attributes and shapes name
    them, so they are not cut."""
    sizes: set[int] = set()
    for n in prog.nodes:
        if n.op in (Op.SLICE, Op.CONCAT):
            sizes |= {prog.types[s].shape[n.attr("dim")] for s in n.inputs} | {prog.types[n.name].shape[n.attr("dim")]}
    return sizes


def small_program(prog: Program, limit: int = SMALL_DIM) -> Program:
    """`prog` with every fixed dim over `limit` cut to `limit` and those of an index input's sizes
    (other than tokens) to SMALL_INDEX_DIM (equal dims stay equal), but for the sizes a slice or
    concat reads (rotary's head and rotary dims): a gathered table keeps its columns and loses rows."""
    kept = _placed_sizes(prog)
    index_sizes = {d for n in prog.inputs if n.attr("dtype") in INDEX_DTYPES for d in n.attr("shape")
                   if not isinstance(d, str)}

    def small(d):
        if isinstance(d, str) or d in kept:
            return d
        return min(d, SMALL_INDEX_DIM) if d in index_sizes else min(d, limit)
    nodes: list[Node] = []
    for n in prog.nodes:
        if n.op == "input":
            shape = tuple(small(d) for d in n.attr("shape"))
            n = node(n.name, "input", shape=shape, dtype=n.attr("dtype"))
        nodes.append(n)
    return Program(prog.name, tuple(nodes), prog.outputs)


# --- adversarial inputs in the kernel's dtype ----------------------------------------------------

OUTLIER = 1e4  # activations of real LLMs carry a few channels in the thousands
OUTLIER_CHANNELS = 2
BOUNDARY_MARGIN = 0.9  # below the reference's own limit, where only a design's own overflow fails
CHECK_TOKENS = (1, 7)  # one token, and an awkward count
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Case:
    """One run of the kernels: what the inputs were, the error against the exact reference, and
    why the case fails (None when it passes)."""

    name: str
    num_tokens: int
    error: float  # max |got - exact| / max |exact| over the outputs (inf: overflow or NaN)
    failure: str | None
    judged: bool = True  # False: the reference itself failed on every output, so nothing was judged


@dataclass(frozen=True)
class NumericVerdict:
    """The numeric check of an instance in one dtype: every case it ran."""

    dtype: str
    cases: tuple[Case, ...]

    @property
    def ok(self) -> bool:
        return all(c.failure is None for c in self.cases)

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(c.failure for c in self.cases if c.failure)

    @property
    def worst_error(self) -> float:
        return max((c.error for c in self.cases if c.judged), default=0.0)


def check_numerics(inst: Instance, dtype: str | None = None, *, tokens: tuple[int, ...] = CHECK_TOKENS,
                   seed: int | None = None, device: str = "cpu") -> NumericVerdict:
    """Run `inst`'s kernels through Triton with inputs in `dtype` (the program's by default):
    a few outlier channels at the largest magnitude the reference survives and at 1e4; then
    fresh random inputs at each of `tokens`, the last with two rows of zeros; where integer inputs
    index a table, they pick its last and first rows at each of `tokens`, then a few rows repeated
    in random order. A case fails when an output overflows (inf) or turns NaN where the
    reference's output, in `dtype`, stays finite, or misses the dtype's tolerance against the
    exact (float64) reference where the float32 reference does not. The check stops at the first
    failing case (each case is a run of the interpreter). The references run on the CPU; the
    kernels on `device` ("cpu": Triton's interpreter)."""
    inst = _retyped(inst, dtype) if dtype else inst
    prog = inst.sgraph.program
    dtype = prog.inputs[0].attr("dtype")
    has_tokens = any(NUM_TOKENS in n.attr("shape") for n in prog.inputs)
    tokens = tokens if has_tokens else tokens[-1:]
    gen = torch.Generator().manual_seed(seed if seed is not None else fresh_seed())
    fresh = lambda: int(torch.randint(2**62, (1,), generator=gen))  # noqa: E731
    at = lambda nt: f", {nt} token{'s' * (nt > 1)}" if has_tokens else ""  # noqa: E731
    big = tokens[-1]

    def plans():  # outliers first: a design unsafe in its dtype fails there, and the check stops
        base = random_inputs(prog, big, seed=fresh())
        largest = _largest_surviving(prog, base, dtype)
        for magnitude in [] if largest is None else [largest, OUTLIER] if largest > OUTLIER else [largest]:
            what = "" if magnitude == OUTLIER else " (the largest the reference survives)"
            yield f"outlier {magnitude:.3g}{what}{at(big)}", big, _outliers(prog, base, magnitude)
        for nt in tokens:
            inputs = random_inputs(prog, nt, seed=fresh())
            if nt == big:
                yield f"random inputs with zero rows{at(nt)}", nt, _zero_rows(prog, inputs)
            else:
                yield f"random inputs{at(nt)}", nt, inputs
        if index_bounds(prog):  # rows picked at the table's edges (one token: the last), repeated in random order
            for nt in tokens:
                yield f"indices at the last and first rows{at(nt)}", nt, \
                    _edge_indices(prog, random_inputs(prog, nt, seed=fresh()))
            inputs = random_inputs(prog, big, seed=fresh())
            yield f"repeated indices in random order{at(big)}", big, _repeated_indices(prog, inputs, gen)

    cases: list[Case] = []
    for name, nt, inputs in plans():
        cases.append(_run(inst, name, nt, inputs, device))
        if cases[-1].failure:
            break
    return NumericVerdict(dtype, tuple(cases))


def _run(inst: Instance, name: str, num_tokens: int, inputs: list[torch.Tensor], device: str = "cpu") -> Case:
    prog = inst.sgraph.program
    dtype = prog.inputs[0].attr("dtype")
    ref, exact, overflowed = _references(prog, inputs)
    out = [torch.full(r.shape, float("nan"), dtype=TORCH_DTYPES[prog.types[o].dtype], device=device)
           for r, o in zip(ref, prog.outputs)]
    with numpy.errstate(all="ignore"):  # padded rows of a masked tile may divide by zero
        got = [g.cpu() for g in compile_instance(inst)(*(t.to(device) for t in inputs), out=out)]
    worst, failure, judged = 0.0, None, False
    for o, g, r, x in zip(prog.outputs, got, ref, exact):
        if overflowed or not _survived(prog, o, r, x):  # the reference fails here too: nothing to judge
            continue
        judged = True
        at = f"in output '{o}' at {name} ({SHORT[dtype]})"
        if torch.isinf(g).any():
            worst, failure = math.inf, failure or f"overflow: inf {at}"
        elif torch.isnan(g).any():
            worst, failure = math.inf, failure or f"NaN {at}"
        else:
            err = max_rel_error(g, x)
            worst = max(worst, err)
            if err > TOLERANCE[dtype]:
                failure = failure or f"error {err:.3g} over the tolerance {TOLERANCE[dtype]:g} {at}"
    return Case(name, num_tokens, worst, failure, judged)


def _references(prog: Program, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """The float32 reference (what a kernel is held to), the exact one (float64), and whether any
    value of the float32 reference overflowed on the way (then it cannot hold a kernel to account)."""
    values: dict[str, torch.Tensor] = {}
    ref = evaluate(prog, inputs, values=values)
    overflowed = any(not torch.isfinite(v).all() for v in values.values())
    return ref, evaluate(prog, inputs, precision=torch.float64), overflowed


def _survived(prog: Program, output: str, ref: torch.Tensor, exact: torch.Tensor) -> bool:
    """The float32 reference survives a case when its output stays finite in the output's dtype and
    within that dtype's tolerance of the exact result."""
    dtype = prog.types[output].dtype
    return bool(torch.isfinite(ref.to(TORCH_DTYPES[dtype])).all()) and max_rel_error(ref, exact) <= TOLERANCE[dtype]


def _activations(prog: Program) -> list[int]:
    """Positions of the float inputs that carry activations: those with a num_tokens dim, else
    (attention) those of the largest rank."""
    ins = [(i, n) for i, n in enumerate(prog.inputs) if n.attr("dtype") not in INDEX_DTYPES]
    tok = [i for i, n in ins if NUM_TOKENS in n.attr("shape")]
    if tok:
        return tok
    rank = max(len(n.attr("shape")) for _, n in ins)
    return [i for i, n in ins if len(n.attr("shape")) == rank]


def _zero_rows(prog: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows (dim -2) 0 and half-way of every activation set to zero (one row: left as it is)."""
    out = list(inputs)
    for i in _activations(prog):
        if out[i].dim() >= 2 and out[i].shape[-2] > 1:
            t = out[i].clone()
            t[..., sorted({0, t.shape[-2] // 2}), :] = 0
            out[i] = t
    return out


def _edge_indices(prog: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every integer input alternating between the last row it may pick and row 0 (the last first:
    one token picks the last row)."""
    out, rows = list(inputs), index_bounds(prog)
    for i, n in enumerate(prog.inputs):
        if n.name in rows:
            t = inputs[i]
            out[i] = torch.tensor([rows[n.name] - 1, 0], dtype=t.dtype).repeat(t.numel())[:t.numel()].reshape(t.shape)
    return out


def _repeated_indices(prog: Program, inputs: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """Every integer input holding a third as many values as elements, each repeated, in random order."""
    out, rows = list(inputs), index_bounds(prog)
    for i, n in enumerate(prog.inputs):
        if n.name in rows:
            t = inputs[i].reshape(-1)
            few = t[:max(1, t.numel() // 3)]
            out[i] = few[torch.randint(few.numel(), (t.numel(),), generator=gen)].reshape(inputs[i].shape)
    return out


def _outlier_channels(prog: Program, inputs: list[torch.Tensor], size: int) -> list[int]:
    """The channels (last dim) where outliers hurt most: where the 1-D inputs of that size (norm
    weights, which multiply the channel) are largest; the first ones when there are none."""
    count = min(OUTLIER_CHANNELS, size)
    vectors = [t.float().abs() for n, t in zip(prog.inputs, inputs) if tuple(n.attr("shape")) == (size,)]
    if not vectors:
        return list(range(count))
    return torch.stack(vectors).amax(0).topk(count).indices.tolist()


def _outliers(prog: Program, inputs: list[torch.Tensor], magnitude: float) -> list[torch.Tensor]:
    """Every activation with its outlier channels at +magnitude and -magnitude, alternately."""
    out = list(inputs)
    for i in _activations(prog):
        t = out[i].clone()
        for j, c in enumerate(_outlier_channels(prog, inputs, t.shape[-1])):
            t[..., c] = magnitude if j % 2 == 0 else -magnitude
        out[i] = t
    return out


def _survives(prog: Program, inputs: list[torch.Tensor]) -> bool:
    ref, exact, overflowed = _references(prog, inputs)
    return not overflowed and all(_survived(prog, o, r, x) for o, r, x in zip(prog.outputs, ref, exact))


def _largest_surviving(prog: Program, base: list[torch.Tensor], dtype: str, steps: int = 40) -> float | None:
    """The largest outlier magnitude (representable in `dtype`) at which the reference survives
    (no float32 value of it overflows, its outputs stay finite in their dtype and within tolerance
    of exact): the dtype's maximum if it survives that, else found by bisection on the exponent,
    less a margin of `BOUNDARY_MARGIN` so that a kernel's other summation order right at the limit
    is not taken for a fault. None when the reference fails already at magnitude 1."""
    top = torch.finfo(TORCH_DTYPES[dtype]).max
    if _survives(prog, _outliers(prog, base, top)):
        return top
    if not _survives(prog, _outliers(prog, base, 1.0)):
        return None
    lo, hi = 0.0, math.log2(top)
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _survives(prog, _outliers(prog, base, 2.0 ** mid)) else (lo, mid)
    return max(1.0, 2.0 ** lo * BOUNDARY_MARGIN)


def _retyped(inst: Instance, dtype: str) -> Instance:
    """`inst` with the Program's float inputs (and intermediates of their dtype) in `dtype`."""
    g = inst.sgraph
    old = g.program.inputs[0].attr("dtype")
    if dtype == old:
        return inst
    if dtype not in TORCH_DTYPES:
        raise SGraphError(f"numeric check: dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    nodes = tuple(node(n.name, "input", shape=n.attr("shape"), dtype=dtype)
                  if n.op == "input" and n.attr("dtype") not in INDEX_DTYPES else n for n in g.program.nodes)
    inter = tuple(replace(t, dtype=dtype) if t.dtype == old else t for t in g.intermediates)
    program = Program(g.program.name, nodes, g.program.outputs)
    return instantiate(SGraph(g.name, program, inter, g.kernels), inst.values, get_gpu(inst.gpu))
