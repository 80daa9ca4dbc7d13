"""Gemma's region kinds in the optimizer: tanh GELU (`gelu_tanh`) and RMSNorm with (1 + weight).

The Programs are compared with references that share no code with prism's: vLLM's own
`GemmaRMSNorm.forward_native` and `GeluAndMul(approximate="tanh").forward_native` (what vLLM's CPU
build runs), and tanh GELU's formula evaluated in float64. Generated kernels run through Triton's
interpreter at a single token, non-power-of-two sizes and magnitudes where the formula's parts
overflow.
"""

from __future__ import annotations

import math

import pytest
import torch

from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.reference import evaluate, max_rel_error, random_inputs
from prism_serve.optimize.ir.sgraph import BlockKernel, GridAxis, SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.optimize.workloads import programs
from prism_serve.optimize.workloads.oracles import default_assignment, load, oracle, store

H100 = get_gpu("h100")


def _gelu_tanh_f64(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation as published (Hendrycks & Gimpel), in float64."""
    x = x.double()
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.fixture(scope="module")
def vllm_layers():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import GeluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read the config when built
        yield GemmaRMSNorm, GeluAndMul


@pytest.mark.parametrize("hidden,tokens", [(96, 1), (100, 7)])
def test_gemma_norms_match_vllm_forward_native(vllm_layers, hidden, tokens):
    gemma_norm, _ = vllm_layers
    eps = 1e-6
    norm = gemma_norm(hidden, eps=eps)
    prog, fused = programs.gemma_rms_norm(hidden, "float32", eps), programs.gemma_fused_add_rms_norm(
        hidden, "float32", eps)
    x, r, w = random_inputs(fused, tokens, seed=3)
    with torch.no_grad():
        norm.weight.copy_(w)
        want = norm.forward_native(x.clone())
        want_y, want_r = norm.forward_native(x.clone(), r.clone())
    (got,) = evaluate(prog, [x, w])
    got_y, got_r = evaluate(fused, [x, r, w])
    assert max_rel_error(got, want) < 1e-6
    assert max_rel_error(got_y, want_y) < 1e-6 and max_rel_error(got_r, want_r) < 1e-6
    # the offset matters: a plain RMSNorm with the same weight is far off
    assert max_rel_error(evaluate(programs.rms_norm(hidden, "float32", eps), [x, w])[0], want) > 0.1


@pytest.mark.parametrize("inter,tokens", [(50, 1), (96, 5)])
def test_gelu_tanh_and_mul_matches_vllm_and_the_formula(vllm_layers, inter, tokens):
    _, gelu_and_mul = vllm_layers
    prog = programs.gelu_tanh_and_mul(inter, "float32")
    gate, up = random_inputs(prog, tokens, seed=4)
    gate = gate * 4  # reach the tails, where tanh saturates
    want = gelu_and_mul(approximate="tanh").forward_native(torch.cat([gate, up], dim=-1))
    (got,) = evaluate(prog, [gate, up])
    assert max_rel_error(got, want) < 1e-6
    assert max_rel_error(got, (_gelu_tanh_f64(gate) * up.double()).float()) < 1e-6
    # and it is not exact GELU: the two differ by far more than rounding
    assert max_rel_error(gelu_and_mul(approximate="none").forward_native(torch.cat([gate, up], -1)), want) > 1e-5


def _gelu_kernel() -> SGraph:
    """y = gelu_tanh(x) on [num_tokens, 37]: the codegen of the op alone."""
    prog = Program("gelu", (node("x", "input", shape=(NUM_TOKENS, 37), dtype="float32"),
                            node("y", "gelu_tanh", "x")), ("y",))
    k = BlockKernel("gelu", (GridAxis("BT", True),), None,
                    (load("x", "x", (0,)), node("g", "gelu_tanh", "x"), store("out", "g", "y", (0,))))
    return SGraph("gelu_kernel", prog, (), (k,))


def test_generated_gelu_tanh_matches_torch_at_every_magnitude():
    """Triton's rendering (x * sigmoid(2u), no tanh) against torch's F.gelu(approximate="tanh"),
    from tiny values to where x^3 overflows float32 (+-1e13): no NaN, same saturation. For x below
    about -5 torch's 0.5 x (1 + tanh(u)) cancels to -0 while the true value is ~1e-7 (the sigmoid
    form keeps it): the two may differ there by a rounding of x's scale, never more."""
    g = _gelu_kernel()
    assert prove_equivalent(g).ok
    run = compile_instance(instantiate(g, {"BT": 4}, H100))
    mags = torch.tensor([0.0, 1e-30, -1e-7, 0.5, -0.5, 3.0, -3.0, 9.0, -9.0, 20.0, -20.0, 1e4, -1e4, 1e13, -1e13])
    x = torch.cat([mags, torch.linspace(-6, 6, 37 * 5 - len(mags))]).reshape(5, 37)
    (got,) = run(x)
    want = torch.nn.functional.gelu(x, approximate="tanh")
    assert not torch.isnan(got).any()
    bound = 2e-6 * want.abs() + 1e-7 * x.abs()
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()
    assert ((got.double() - _gelu_tanh_f64(x)).abs() <= bound.double()).all()
    assert (got[x > 0] > 0).all() and got.flatten()[11] == 1e4 and got.flatten()[13] == 1e13


@pytest.mark.parametrize("name,dims,tokens", [
    ("gemma_rms_norm", {"hidden": 100}, (1, 3)), ("gemma_fused_add_rms_norm", {"hidden": 72}, (1, 5)),
    ("gelu_tanh_and_mul", {"intermediate": 50}, (1, 6)), ("geglu", {"hidden": 40, "intermediate": 24}, (1, 7))])
def test_oracle_kernels_match_vllm_semantics_at_awkward_shapes(name, dims, tokens):
    prog = getattr(programs, name)(*dims.values(), dtype="float32")
    g = oracle(prog)
    assert prove_equivalent(g).ok
    run = compile_instance(instantiate(g, default_assignment(g, target_tile=16), H100))
    for n in tokens:
        inputs = random_inputs(prog, n, seed=n)
        if name == "gemma_rms_norm":
            x, w = inputs
            want = [torch.nn.functional.rms_norm(x, (x.shape[-1],), 1 + w, 1e-6)]
        elif name == "gemma_fused_add_rms_norm":
            x, r, w = inputs
            want = [torch.nn.functional.rms_norm(x + r, (x.shape[-1],), 1 + w, 1e-6), x + r]
        elif name == "gelu_tanh_and_mul":
            want = [_gelu_tanh_f64(inputs[0]).float() * inputs[1]]
        else:
            x, wg, wu = inputs
            want = [_gelu_tanh_f64(x @ wg.T).float() * (x @ wu.T)]
        errors = [max_rel_error(a, b) for a, b in zip(run(*inputs), want)]
        assert len(errors) == len(want) and max(errors) < 1e-5, errors
