"""Shared check: run an instantiated sGraph through Triton on fresh inputs against the reference."""

from __future__ import annotations

import torch

from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.ir.reference import TOLERANCE, TORCH_DTYPES, evaluate, max_rel_error, random_inputs
from prism_serve.optimize.target.instance import Instance


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
