"""Static GPU facts of the embedded model's GEMM kernels: compiled by Triton for sm_90 and sm_80 on
this machine, ptxas's cubin must show no spills at 1-16 tokens (issue 13's target), and a
tensor-core instruction wherever the resource model says codegen emitted tl.dot (bf16, as a GPU serves the model); the model's register
estimate is within 25 % of ptxas's count (issue 13's target, over all kernels in bench_static)."""

import pytest

from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.instantiate.static import compile_facts, compiler_versions
from prism_serve.optimize.instantiate.tune import Candidate, enumerate_instances, rank, screen
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.designs import on_tf32
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS
from scripts.bench_static import REG_TOLERANCE, TARGETS, embedded_programs


# chosen kernels whose register estimate is known to miss ptxas's by more than REG_TOLERANCE, and
# why; each is checked to still miss, so this shrinks as the model improves (issue 13's target is none)
KNOWN_OFF = {(80, "rmsnorm_swiglu", 256): "8 warps, a 64-row tile and all of K (128) in one step, no loop: the "
             "model counts the normed chain and the row sums as live (108), ptxas keeps 80"}


@pytest.mark.parametrize("capability", sorted(TARGETS))
def test_embedded_gemm_kernels_do_not_spill_and_use_tensor_cores(capability):
    gpu = get_gpu(TARGETS[capability])
    programs = embedded_programs("tiny-llama")
    jobs = []
    # at 1-16 tokens the tiny-llama designs tie at one DRAM latency and the tie goes to the fewest bytes
    # requested, whole-row tiles with tl.dot; at 256 tokens too
    cases = (("rmsnorm_linear", 1), ("rmsnorm_linear", 16), ("rmsnorm_swiglu", 16), ("rmsnorm_swiglu", 256))
    for kind, num_tokens in cases:
        g = oracle(programs[kind])
        jobs.append((rank(g, gpu, num_tokens, enumerate_instances(g, gpu))[0].instance, capability))
    assert any(inst.resources(inst.sgraph.kernels[0]).dots for inst, _ in jobs)  # tensor cores are exercised
    for (inst, _), facts, (kind, num_tokens) in zip(jobs, compile_facts(jobs), cases):
        (k,) = inst.sgraph.kernels
        (f,) = facts
        assert num_tokens > 16 or not f.spills, f"{inst.sgraph.name} {inst.values}: {f.stack_bytes} stack bytes per thread"
        assert f.num_warps == inst.warps(k)
        estimate = inst.resources(k).regs_per_thread
        within = abs(estimate - f.registers) <= REG_TOLERANCE * f.registers
        assert within != ((capability, kind, num_tokens) in KNOWN_OFF), \
            f"{inst.values}: {estimate} vs ptxas {f.registers}"
        if inst.resources(k).dots:
            assert f.tensor_core_instructions > 0, f"{inst.sgraph.name} {inst.values}: tl.dot without HMMA/HGMMA"


def test_a_dot_on_tf32_operands_compiles_to_tensor_core_instructions():
    """fp16 rmsnorm_linear with x * g kept in fp32 for its dot (`ir.TF32`), at the tuner's 16-token
    instance: Triton emits tf32 MMAs (HMMA on sm_80, and on sm_90 for a 16-row tile), no spill."""
    g = on_tf32(oracle(WORKLOADS["rmsnorm_linear"].program()))
    jobs = [(rank(g, get_gpu(TARGETS[cc]), 16, enumerate_instances(g, get_gpu(TARGETS[cc])))[0].instance, cc)
            for cc in sorted(TARGETS)]
    for inst, _ in jobs:
        source = render(inst, interpret=False)
        assert 'input_precision="tf32"' in source and "_round_tf32" not in source
    for (inst, cc), (f,) in zip(jobs, compile_facts(jobs)):
        assert f.tensor_core_instructions > 0 and not f.spills, (cc, inst.values, f)


def test_the_facts_name_the_triton_and_ptxas_that_made_them():
    """Registers and spills differ between Triton releases (one kernel spills under Triton 3.6 and not 3.9),
    so bench_static records the versions: Triton's own, and the ptxas release its wheel ships."""
    import triton
    versions = compiler_versions()
    assert versions["triton"] == triton.__version__
    assert versions["ptxas"].startswith("Cuda compilation tools, release ")


def test_the_screen_takes_the_best_ranked_instance_ptxas_does_not_spill():
    """`tune.screen` against ptxas's own facts, compiled apart: in a ranking whose first instance
    spills on sm_80 (fp16 swiglu at H100 shapes, a 32 x 128 tile with a 128-wide K step: 8 stack
    bytes per thread under Triton 3.9), the second is taken, with its facts; a ranking of that
    instance alone keeps it, since nothing better was ranked."""
    g = oracle(WORKLOADS["swiglu"].program())
    gpu = get_gpu("a100")
    spiller = instantiate(g, {"BT": 32, "F": 128, "G": 128}, gpu)
    clean = rank(g, gpu, 16, enumerate_instances(g, gpu))[0].instance
    direct = compile_facts([(spiller, 80), (clean, 80)])
    if not any(f.spills for f in direct[0]):  # measured under Triton 3.9; pick another case for this one
        pytest.skip(f"the case does not spill under this Triton: {direct[0]}")
    assert not any(f.spills for f in direct[1])
    first, second = Candidate(spiller, 16, 1.0), Candidate(clean, 16, 2.0)
    (taken,), (kept,) = screen([[first, second], [first]], 80)
    assert taken.instance is clean and taken.facts == tuple(direct[1]) and taken.modeled_us == 2.0
    assert kept.instance is spiller and kept.facts == tuple(direct[0])


def test_the_screen_leaves_rankings_unscreened_where_ptxas_cannot_compile(caplog):
    """An architecture this Triton does not target (sm_10): a warning, and the best-ranked instance, unchecked."""
    g = oracle(WORKLOADS["silu_and_mul"].program(intermediate=64))
    gpu = get_gpu("h100")
    ranking = rank(g, gpu, 4, enumerate_instances(g, gpu))[:2]
    assert screen([ranking], 10) == [ranking[:1]]
    assert "not checked by ptxas for sm_10" in caplog.text
