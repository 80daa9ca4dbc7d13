"""The numeric check's adversarial inputs: the fp16 design that multiplies the unnormalised x * g
into the dot overflows on outlier channels and is rejected by name; the normalised design passes."""

from __future__ import annotations

import torch

from prism_serve.optimize.ir.program import node
from prism_serve.optimize.ir.reference import random_inputs
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.check import _largest_surviving, _outliers, _survives, check_numerics
from prism_serve.optimize.workloads.designs import on_tf32, rms_then_projection
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

H100 = get_gpu("h100")
DIMS = {"hidden": 48, "out": 40}  # not powers of two: padded, masked tiles
ASSIGN = {"BT": 16, "G": 2, "F": 3}  # 16-row blocks of 16-wide hidden steps: the tl.dot path on a GPU


def test_fp16_rms_after_the_dot_overflows_and_is_rejected_by_name():
    prog = WORKLOADS["rmsnorm_linear"].program(**DIMS, dtype="float16")
    inst = instantiate(oracle(prog), ASSIGN, H100)  # 1/rms pulled past the projection
    verdict = check_numerics(inst, seed=0)
    assert not verdict.ok
    assert any(r.startswith("overflow: inf in output 'y' at outlier 6.55e+04") and r.endswith("(fp16)")
               for r in verdict.reasons), verdict.reasons
    # the outlier cases run first (an unsafe design fails there), and the check stops at the first failure
    assert len(verdict.cases) == 1 and verdict.cases[0].name.startswith("outlier") and len(verdict.reasons) == 1
    # The mechanism, in plain torch: the fp16 operand x * g is out of range, vLLM's path is not.
    x, g, w = random_inputs(prog, 7, seed=0)
    c = int(g.float().abs().argmax())
    x[:, c] = 65504.0
    assert torch.isinf((x.float() * g.float()).half()).any()
    xn = torch.nn.functional.rms_norm(x.float(), (DIMS["hidden"],), g.float(), 1e-6).half()
    assert torch.isfinite(xn.float() @ w.float().T).all()


def test_the_same_design_passes_in_fp32():
    prog = WORKLOADS["rmsnorm_linear"].program(**DIMS, dtype="float16")
    verdict = check_numerics(instantiate(oracle(prog), ASSIGN, H100), "float32", seed=0)
    assert verdict.ok and verdict.dtype == "float32" and all(c.judged for c in verdict.cases)


def test_the_same_design_on_tf32_operands_passes_in_fp16():
    """x * g kept in fp32 for the dot (TF32: fp16's mantissa, fp32's range) survives the outliers
    that overflow its fp16 twin, within the fp16 tolerance: the generator's safe one-kernel form."""
    prog = WORKLOADS["rmsnorm_linear"].program(**DIMS, dtype="float16")
    verdict = check_numerics(instantiate(on_tf32(oracle(prog)), ASSIGN, H100), seed=0)
    assert verdict.ok, verdict.reasons
    assert any(c.name.startswith("outlier 6.55e+04") for c in verdict.cases) and all(c.judged for c in verdict.cases)


def test_normalised_operand_before_the_dot_passes_in_fp16():
    prog = WORKLOADS["rmsnorm_linear"].program(**DIMS, dtype="float16")
    inst = instantiate(rms_then_projection(prog), ASSIGN | {"BR": 4, "FR": 2}, H100)
    verdict = check_numerics(inst, seed=0)
    assert verdict.ok, verdict.reasons
    assert {c.name.split(" (")[0] for c in verdict.cases} == {
        "random inputs, 1 token", "random inputs with zero rows, 7 tokens", "outlier 1e+04, 7 tokens", "outlier 6.55e+04"}
    assert all(c.judged for c in verdict.cases) and verdict.worst_error < 2e-3


def test_zero_rows_catch_a_missing_epsilon():
    """rsqrt(mean(x^2)) without epsilon: within tolerance on random rows, NaN on a zero row."""
    g = oracle(WORKLOADS["rms_norm"].program(hidden=40, dtype="float32"))
    k = g.kernels[0]
    nodes = tuple(node("r", "rsqrt", "ms") if n.name == "r" else n for n in k.nodes)
    mutant = SGraph("no_eps", g.program, (), (BlockKernel(k.name, k.grid, k.forloop, nodes),))
    verdict = check_numerics(instantiate(mutant, {"BT": 4}, H100), seed=0)
    assert [(c.name, c.failure) for c in verdict.cases][-3:] == [
        ("outlier 1e+04, 7 tokens", None), ("random inputs, 1 token", None),
        ("random inputs with zero rows, 7 tokens",
         "NaN in output 'y' at random inputs with zero rows, 7 tokens (fp32)")]


def test_largest_surviving_magnitude():
    norm = WORKLOADS["rmsnorm_linear"].program(**DIMS, dtype="float16")
    assert _largest_surviving(norm, random_inputs(norm, 7, seed=0), "float16") == 65504.0  # fp16's max
    # without a norm the projection grows with the outlier: the reference overflows fp16 first
    plain = WORKLOADS["swiglu"].program(hidden=48, dtype="float16")
    base = random_inputs(plain, 7, seed=0)
    m = _largest_surviving(plain, base, "float16")
    assert 1.0 < m < 1e4
    assert _survives(plain, _outliers(plain, base, m)) and not _survives(plain, _outliers(plain, base, 2.5 * m))
    assert not _survives(plain, _outliers(plain, base, 1e4))


def test_largest_surviving_magnitude_stops_where_the_reference_output_overflows():
    """x and residual carry the same outlier channels: their sum, an output, leaves fp16 once
    2m > 65504, so the magnitude used is 90% of 65504 / 2 (to fp16 rounding of the sum)."""
    prog = WORKLOADS["fused_add_rmsnorm_linear"].program(hidden=48, out=40, dtype="float16")
    m = _largest_surviving(prog, random_inputs(prog, 7, seed=0), "float16")
    assert 0.89 * 32752 < m < 0.91 * 32752
