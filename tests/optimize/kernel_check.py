"""Shared check: run an instantiated sGraph through Triton on fresh inputs against the reference."""

from __future__ import annotations

import torch

from prism_serve.optimize.codegen import compile_instance
from prism_serve.optimize.reference import TORCH_DTYPES, evaluate, random_inputs
from prism_serve.optimize.sgraph import Instance

# max |got - ref| / max |ref|: fp32 accumulates in fp32; halves are bounded by output rounding,
# and bf16 by the interpreter's truncating cast (1 ulp, see ENVIRONMENT.md).
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_instance(inst: Instance, num_tokens: int, dtype: str) -> list[float]:
    """Errors per output; outputs are NaN-poisoned first, so any element left unwritten fails."""
    prog = inst.sgraph.program
    run = compile_instance(inst)
    inputs = random_inputs(prog, num_tokens)
    ref = evaluate(prog, inputs)
    poisoned = [torch.full(r.shape, float("nan"), dtype=TORCH_DTYPES[dtype]) for r in ref]
    got = run(*inputs, out=poisoned)
    errors = []
    for g, p, r in zip(got, poisoned, ref):
        assert g.data_ptr() == p.data_ptr(), "launcher ignored the preallocated output"
        assert not torch.isnan(g).any(), "an output element was left unwritten"
        errors.append(max_rel_error(g, r))
    assert max(errors) < TOLERANCE[dtype], f"errors {errors} over tolerance {TOLERANCE[dtype]}"
    return errors
