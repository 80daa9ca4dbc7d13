"""The yardstick of every speedup: vLLM's path for each region kind, run with vLLM's own ops and
modeled by the cost model that prices prism's kernels."""

import pytest

from prism_serve.baseline import baseline, served_modeled_us, vllm_modeled_us
from prism_serve.optimize.instantiate.cost import unfused_us
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.reference import evaluate, max_rel_error, random_inputs
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.workloads import programs
from prism_serve.region_table import KINDS

PROGRAMS = {
    "rms_norm": programs.rms_norm(96, "float32"),
    "fused_add_rms_norm": programs.fused_add_rms_norm(96, "float32"),
    "silu_and_mul": programs.silu_and_mul(48, "float32"),
    "rmsnorm_linear": programs.rmsnorm_linear(96, 40, "float32"),
    "fused_add_rmsnorm_linear": programs.fused_add_rmsnorm_linear(96, 40, "float32"),
    "rmsnorm_linear_bias": programs.rmsnorm_linear_bias(96, 40, "float32"),
    "fused_add_rmsnorm_linear_bias": programs.fused_add_rmsnorm_linear_bias(96, 40, "float32"),
    "swiglu": programs.swiglu(64, 48, "float32"),
    "rmsnorm_swiglu": programs.rmsnorm_swiglu(64, 48, "float32"),
    "rmsnorm_geglu": programs.rmsnorm_geglu(64, 48, "float32"),
    "gemma_rms_norm": programs.gemma_rms_norm(96, "float32"),
    "gemma_fused_add_rms_norm": programs.gemma_fused_add_rms_norm(96, "float32"),
    "gelu_tanh_and_mul": programs.gelu_tanh_and_mul(48, "float32"),
    "geglu": programs.geglu(64, 48, "float32"),
    "gemma_rmsnorm_linear": programs.gemma_rmsnorm_linear(96, 40, "float32"),
    "gemma_fused_add_rmsnorm_linear": programs.gemma_fused_add_rmsnorm_linear(96, 40, "float32"),
    "gemma_rmsnorm_geglu": programs.gemma_rmsnorm_geglu(64, 48, "float32"),
    # vLLM's rotary_embedding kernel in place (GPT-J, half the head), QK-norm's RMSNorms before it (NeoX)
    "rotary": programs.rotary(3, 1, 16, 8, 40, "float32", "gptj"),
    "qk_norm_rotary": programs.qk_norm_rotary(4, 2, 16, 16, 40, 1e-6, "float32"),
    # vLLM's CPU fused MoE on its packed weights (hidden and intermediate in multiples of 32)
    "moe_experts": programs.moe_experts(4, 2, 64, 32, "float32"),
    "moe_experts_gelu_tanh": programs.moe_experts_gelu_tanh(4, 2, 64, 32, "float32"),
}


def test_every_region_kind_has_a_baseline():
    assert set(PROGRAMS) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(PROGRAMS))
def test_vllms_own_ops_compute_the_program(kind):
    prog = PROGRAMS[kind]
    base = baseline(prog)
    assert base.name == "vllm"
    for num_tokens in (1, 7):
        inputs = random_inputs(prog, num_tokens, seed=num_tokens)
        ref = evaluate(prog, inputs)
        got = base.run(*base.prepare([t.clone() for t in inputs]))
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert max_rel_error(g, r) < 1e-5


def test_vllms_fused_moe_is_priced_as_two_grouped_gemms_over_the_experts_chosen():
    """One token reads its k experts' weights; many tokens read every expert once, so the time per
    token falls as tokens share experts; the GELU form costs what the SiLU form does, give or take
    its activation kernel."""
    gpu = get_gpu("h100")
    prog = programs.moe_experts(128, 8, 2048, 768, "bfloat16")
    one, many = vllm_modeled_us(prog, 1, gpu), vllm_modeled_us(prog, 256, gpu)
    weights = 2 * 3 * 2048 * 768  # bytes of one expert's w13 and w2 in bf16
    assert one > 8 * weights / (gpu.mem_bandwidth_gbs * 1e3) and many > 128 * weights / (gpu.mem_bandwidth_gbs * 1e3)
    assert many / 256 < one
    gelu = vllm_modeled_us(programs.moe_experts_gelu_tanh(128, 8, 2048, 768, "bfloat16"), 16, gpu)
    assert gelu == pytest.approx(vllm_modeled_us(prog, 16, gpu), rel=0.2)


def test_the_modeled_path_is_vllms_kernels_priced_by_the_cost_model():
    gpu = get_gpu("h100")
    for n in (1, 16, 300):
        norm, add = vllm_modeled_us(PROGRAMS["rms_norm"], n, gpu), vllm_modeled_us(PROGRAMS["fused_add_rms_norm"], n, gpu)
        assert add > norm > 0
        # rmsnorm_linear is vLLM's norm kernel then its GEMM, one library kernel
        gemm = unfused_us(Program("linear", (node("x", "input", shape=(NUM_TOKENS, 96), dtype="float32"),
                                             node("w", "input", shape=(40, 96), dtype="float32"),
                                             node("y", "matmul", "x", "w", transpose_b=True)), ("y",)), n, gpu)
        assert vllm_modeled_us(PROGRAMS["rmsnorm_linear"], n, gpu) == pytest.approx(norm + gemm)
        assert vllm_modeled_us(PROGRAMS["fused_add_rmsnorm_linear"], n, gpu) - vllm_modeled_us(
            PROGRAMS["rmsnorm_linear"], n, gpu) == pytest.approx(add - norm)
        # the residual add the plugin runs before rmsnorm_swiglu's kernel is counted on prism's side
        assert served_modeled_us(PROGRAMS["rmsnorm_swiglu"], 10.0, n, gpu) > 10.0
        assert served_modeled_us(PROGRAMS["swiglu"], 10.0, n, gpu) == 10.0
        # QK-norm + rotary: vLLM's RMSNorm over q's rows (tokens x heads) and k's, then its rotary kernel
        qk = PROGRAMS["qk_norm_rotary"]
        rows = [vllm_modeled_us(programs.rms_norm(16, "float32", 1e-6), n * h, gpu) for h in (4, 2)]
        rotary = vllm_modeled_us(programs.rotary(4, 2, 16, 16, 40, "float32"), n, gpu)
        assert vllm_modeled_us(qk, n, gpu) == pytest.approx(sum(rows) + rotary) and rotary > 0
