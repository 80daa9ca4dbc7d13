"""Each captured Program, evaluated on the layer's weights and an input recorded in vLLM,
reproduces that layer's output in vLLM (fp32, relative error < 1e-5)."""

from __future__ import annotations


import torch

from prism_serve.optimize.reference import evaluate, max_rel_error

TOL = 1e-5


def _check_all(result):
    checked = 0
    for inst in result.instances:
        if not inst.supported:
            continue
        assert [n for n, _, _ in inst.recordings] == result.recorded_num_tokens
        for n, inputs, outputs in inst.recordings:
            assert inputs and outputs, f"{inst.kind} at {inst.modules}: nothing recorded"
            got = evaluate(inst.program, inputs)
            assert len(outputs) <= len(got)
            for g, want in zip(got, outputs):
                assert want.abs().max() > 0, f"{inst.kind} at {inst.modules}: recorded output is all zeros"
                err = max_rel_error(g, want.float())
                assert err < TOL, f"{inst.kind} at {inst.modules}, num_tokens {n}: rel err {err:.2e}"
        checked += 1
    return checked


def test_llama_fidelity(llama_capture):
    assert llama_capture.recorded_num_tokens == [7, 1]  # the prefill and one decode step
    assert _check_all(llama_capture) == 13  # 6 per layer + the final norm


def test_qwen3_fidelity(qwen3_capture):
    assert _check_all(qwen3_capture) == 17  # + q_norm, k_norm per layer


def test_the_comparison_is_sharp(llama_capture):
    """Negative control: a slightly wrong epsilon or weight is caught."""
    inst = next(i for i in llama_capture.instances if i.kind == "rmsnorm_linear")
    from prism_serve.optimize.workloads.programs import rmsnorm_linear

    wrong_eps = rmsnorm_linear(inst.dims["hidden"], inst.dims["out"], "float32", 1e-2)
    assert max_rel_error(evaluate(wrong_eps, inst.inputs)[0], inst.outputs[0]) > TOL
    inputs = list(inst.inputs)
    inputs[2] = inputs[2] * (1 + 1e-3 * torch.randn_like(inputs[2]))
    assert max_rel_error(evaluate(inst.program, inputs)[0], inst.outputs[0]) > TOL
