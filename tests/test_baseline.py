"""The yardstick warmup times kernels against: vLLM's own ops where they take the Program's inputs."""

import pytest

from prism_serve.baseline import baseline
from prism_serve.optimize.reference import evaluate, max_rel_error, random_inputs
from prism_serve.optimize.workloads import programs


@pytest.mark.parametrize("prog,expected", [
    (programs.rms_norm(96, "float32"), "vllm"),
    (programs.fused_add_rms_norm(96, "float32"), "vllm"),
    (programs.rmsnorm_linear(96, 40, "float32"), "vllm"),
    (programs.swiglu(64, 48, "float32"), "torch-eager"),
    (programs.silu_and_mul(48, "float32"), "torch-eager"),
], ids=lambda v: getattr(v, "name", v))
def test_baseline_computes_the_program(prog, expected):
    name, run = baseline(prog)
    assert name == expected
    for num_tokens in (1, 7):
        inputs = random_inputs(prog, num_tokens, seed=num_tokens)
        ref = evaluate(prog, inputs)
        got = run(*[t.clone() for t in inputs])  # vLLM's fused_add_rms_norm works in place
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert max_rel_error(g, r) < 1e-5
