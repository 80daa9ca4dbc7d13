"""Reference evaluation of a Program in torch, and the expansion of composite ops.

The reference computes in float32 whatever the declared dtypes, so it is the
yardstick that every generated kernel (fp32 or half precision) is compared to.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import torch

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.ops import OPS, Op
from prism_serve.optimize.ir.program import INDEX_DTYPES, NUM_TOKENS, Node, Program, bind_shape, node

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TORCH_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def expand_composites(prog: Program) -> Program:
    """Rewrite every rms_norm into primitives: x * rsqrt(mean(x*x, -1) + eps) [* w].

    A pure pass: the result computes the same function with primitive ops only.
    """
    nodes: list[Node] = []
    for n in prog.nodes:
        if n.op != Op.RMS_NORM:
            nodes.append(n)
            continue
        x, p = n.inputs[0], f"{n.name}."
        nodes += [
            node(p + "sq", Op.SQUARE, x),
            node(p + "ms", Op.MEAN, p + "sq", dim=-1, keepdim=True),
            node(p + "eps", Op.CONST, value=n.attr("eps")),
            node(p + "var", Op.ADD, p + "ms", p + "eps"),
            node(p + "r", Op.RSQRT, p + "var"),
        ]
        if len(n.inputs) == 2:
            nodes += [node(p + "xr", Op.MUL, x, p + "r"), node(n.name, Op.MUL, p + "xr", n.inputs[1])]
        else:
            nodes.append(node(n.name, Op.MUL, x, p + "r"))
    return Program(prog.name, tuple(nodes), prog.outputs)


def _apply(n: Node, args: list[torch.Tensor], precision: torch.dtype = torch.float32) -> torch.Tensor:
    if n.op == Op.CONST:
        return torch.tensor(n.attr("value"), dtype=precision)
    reference = OPS[n.op].torch
    if reference is None:
        raise AssertionError(n.op)
    return reference(args, dict(n.attrs))


def evaluate(prog: Program, inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
             precision: torch.dtype = torch.float32, values: dict | None = None) -> list[torch.Tensor]:
    """Run `prog` on concrete tensors (in signature order, or by name); results in `precision`
    (float32; float64 tells how far the float32 reference itself is from exact). `values`, if
    given, receives every node's value (of the expanded program), e.g. to see where it overflows.

    The symbol num_tokens must take one value across all inputs.
    """
    decl = prog.inputs
    if isinstance(inputs, Mapping):
        missing = [n.name for n in decl if n.name not in inputs]
        if missing:
            raise ProgramError(f"program '{prog.name}': inputs missing: {missing}")
        inputs = [inputs[n.name] for n in decl]
    if len(inputs) != len(decl):
        raise ProgramError(f"program '{prog.name}': expects {len(decl)} inputs, got {len(inputs)}")
    num_tokens: int | None = None
    env: dict[str, torch.Tensor] = {}
    for n, t in zip(decl, inputs):
        shape = n.attr("shape")
        if t.dim() != len(shape):
            raise ProgramError(f"input '{n.name}': expected rank {len(shape)}, got shape {tuple(t.shape)}")
        for want, got in zip(shape, t.shape):
            if want == NUM_TOKENS:
                num_tokens = got if num_tokens is None else num_tokens
                if got != num_tokens:
                    raise ProgramError(f"input '{n.name}': num_tokens is {got} here but {num_tokens} elsewhere")
            elif want != got:
                raise ProgramError(f"input '{n.name}': expected shape {shape}, got {tuple(t.shape)}")
        env[n.name] = t.to(torch.int64 if n.attr("dtype") in INDEX_DTYPES else precision)
    for n in expand_composites(prog).nodes:
        if n.op != "input":
            env[n.name] = _apply(n, [env[s] for s in n.inputs], precision)
    if values is not None:
        values.update(env)
    return [env[o] for o in prog.outputs]


def fresh_seed() -> int:
    """A seed from the OS for an unseeded draw (torch.seed() would reseed torch's global generator,
    making every later draw of the caller's process depend on this one)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def index_bounds(prog: Program) -> dict[str, int]:
    """Per integer input, how many rows its values may pick: the smallest gathered dim it indexes
    (1 for an index no gather reads)."""
    rows: dict[str, int] = {}
    for n in prog.nodes:
        if n.op == Op.GATHER:
            table = prog.types[n.inputs[0]].shape
            size = table[n.attr("dim") % len(table)]
            rows[n.inputs[1]] = min(rows.get(n.inputs[1], size), size)
    return {n.name: rows.get(n.name, 1) for n in prog.inputs if n.attr("dtype") in INDEX_DTYPES}


def random_inputs(prog: Program, num_tokens: int, *, seed: int | None = None,
                  device: str = "cpu", dtype: str | None = None) -> list[torch.Tensor]:
    """Fresh random inputs for `prog` (standard normal, scaled so matmuls stay O(1)); an integer
    input's values uniform in [0, rows it may pick) (`index_bounds`), in its own dtype. `dtype`
    overrides the float inputs' dtype only."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else fresh_seed())
    bounds = index_bounds(prog)
    out = []
    for n in prog.inputs:
        shape = bind_shape(n.attr("shape"), num_tokens)
        if n.name in bounds:
            t = torch.randint(0, bounds[n.name], shape, generator=gen, dtype=torch.int64)
            out.append(t.to(device=device, dtype=TORCH_INDEX_DTYPES[n.attr("dtype")]))
            continue
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) >= 2:
            t = t / shape[-1] ** 0.25
        out.append(t.to(device=device, dtype=TORCH_DTYPES[dtype or n.attr("dtype")]))
    return out


# max |got - ref| / max |ref| allowed per output dtype: fp32 accumulates in fp32; halves are
# bounded by output rounding, bf16 also by the interpreter's truncating cast (1 ulp).
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float().cpu() - ref.cpu()).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def agreement_limit(exact: torch.Tensor, dtype: str) -> float:
    """How far (`max_rel_error`) two results of one computation, each rounded to `dtype`, may lie
    apart: the dtype's tolerance plus one unit in its last place at the answer's scale (twice what
    rounding the exact answer to `dtype` loses). Where the answer is tiny the rounding alone parts
    them by more than the tolerance: float16 values under 6.1e-5 are subnormal, with fewer bits (the
    embedded model's fp16 projections, near 1e-5, land one ulp, 9.6e-3 of the largest, apart)."""
    return TOLERANCE[dtype] + 2 * max_rel_error(exact.to(TORCH_DTYPES[dtype]), exact)


def as_torch_function(prog: Program):
    """The Program as a plain torch function in its inputs' own dtype: the eager baseline
    (and what torch.compile is given). rms_norm runs as torch's own fused op."""
    nodes = [n for n in prog.nodes if n.op != "input"]
    names = [n.name for n in prog.inputs]

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = dict(zip(names, inputs))
        for n in nodes:
            args = [env[s] for s in n.inputs]
            if n.op == Op.RMS_NORM:
                x = args[0]
                env[n.name] = torch.nn.functional.rms_norm(x, (x.shape[-1],), args[1] if len(args) > 1 else None,
                                                           n.attr("eps"))
            elif n.op == "const":
                env[n.name] = n.attr("value")
            else:
                env[n.name] = _apply(n, args)
        return tuple(env[o] for o in prog.outputs)

    return run
