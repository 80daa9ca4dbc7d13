"""The numeric second line of verification: run generated Triton on fresh random inputs
against the torch reference, at a small instantiation of the same plan."""

from __future__ import annotations

import torch

from prism_serve.optimize.codegen import compile_instance
from prism_serve.optimize.ir import Node, Program, node
from prism_serve.optimize.reference import TORCH_DTYPES, evaluate, max_rel_error, random_inputs
from prism_serve.optimize.sgraph import Instance

SMALL_DIM = 48  # not a power of two, so padding and masks are exercised


def small_program(prog: Program, limit: int = SMALL_DIM) -> Program:
    """`prog` with every fixed dim over `limit` cut to `limit` (equal dims stay equal)."""
    nodes: list[Node] = []
    for n in prog.nodes:
        if n.op == "input":
            shape = tuple(d if isinstance(d, str) or d <= limit else limit for d in n.attr("shape"))
            n = node(n.name, "input", shape=shape, dtype=n.attr("dtype"))
        nodes.append(n)
    return Program(prog.name, tuple(nodes), prog.outputs)


def numeric_errors(inst: Instance, num_tokens: int, *, seed: int | None = None, device: str = "cpu") -> list[float]:
    """Max error relative to max |reference| per output. Outputs are NaN-poisoned first, so an
    element the kernels leave unwritten shows up as an infinite error."""
    prog = inst.sgraph.program
    run = compile_instance(inst)
    inputs = random_inputs(prog, num_tokens, seed=seed, device=device)
    ref = evaluate(prog, inputs)
    out = [torch.full(r.shape, float("nan"), dtype=TORCH_DTYPES[prog.types[o].dtype], device=device)
           for r, o in zip(ref, prog.outputs)]
    got = run(*inputs, out=out)
    return [float("inf") if torch.isnan(g).any() else max_rel_error(g, r) for g, r in zip(got, ref)]
