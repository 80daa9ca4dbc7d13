"""The egglog proof: every oracle is proven, and each kind of wrong sGraph is rejected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.ir.program import node
from prism_serve.optimize.ir.reference import (
    TOLERANCE,
    evaluate,
    max_rel_error,
    random_inputs,
)
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.proof import (
    ITERATIONS,
    ProofResult,
    _Ctx,
    program_terms,
    prove_equivalent,
    sgraph_terms,
)
from prism_serve.optimize.workloads.oracles import (
    ORACLES,
    default_assignment,
    load,
    oracle,
)
from prism_serve.optimize.workloads.programs import WORKLOADS

DIMS = {"rms_norm": {"hidden": 64}, "fused_add_rms_norm": {"hidden": 64}, "silu_and_mul": {"intermediate": 64},
        "rmsnorm_linear": {"hidden": 64, "out": 32}, "fused_add_rmsnorm_linear": {"hidden": 64, "out": 32},
        "rmsnorm_linear_bias": {"hidden": 64, "out": 32}, "fused_add_rmsnorm_linear_bias": {"hidden": 64, "out": 32},
        "swiglu": {"hidden": 64, "intermediate": 64},
        "rmsnorm_mlp": {"hidden": 64, "intermediate": 32},
        "rmsnorm_swiglu": {"hidden": 64, "intermediate": 32}, "rmsnorm_geglu": {"hidden": 64, "intermediate": 32},
        "gemma_rms_norm": {"hidden": 64}, "gemma_fused_add_rms_norm": {"hidden": 64},
        "gelu_tanh_and_mul": {"intermediate": 64}, "geglu": {"hidden": 64, "intermediate": 32},
        "gemma_rmsnorm_linear": {"hidden": 64, "out": 32}, "gemma_fused_add_rmsnorm_linear": {"hidden": 64, "out": 32},
        "gemma_rmsnorm_geglu": {"hidden": 64, "intermediate": 32},
        "attention": {"batch": 1, "heads": 2, "q_len": 1, "kv_len": 64, "head_dim": 16, "kv_heads": 1},
        "qk_norm_attention": {"batch": 1, "heads": 2, "q_len": 1, "kv_len": 64, "head_dim": 16, "kv_heads": 1},
        "rotary": {"num_q_heads": 3, "num_kv_heads": 1, "head_dim": 16, "max_position": 32},
        "qk_norm_rotary": {"num_q_heads": 3, "num_kv_heads": 1, "head_dim": 16, "max_position": 32},
        "moe_experts": {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 48},
        "moe_experts_gelu_tanh": {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 48}}
PROVEN = tuple(sorted(ORACLES))


def _oracle(name: str, **dims) -> SGraph:
    return oracle(WORKLOADS[name].program(**(DIMS[name] | dims), dtype="float32"))


def _edit(g: SGraph, kernel: int, edit) -> SGraph:
    """A new sGraph whose `kernel`-th block graph is `edit(list of nodes)`."""
    k = g.kernels[kernel]
    nodes = edit(list(k.nodes))
    kernels = list(g.kernels)
    kernels[kernel] = BlockKernel(k.name, k.grid, k.forloop, tuple(nodes))
    return SGraph(g.name + "_mutant", g.program, g.intermediates, tuple(kernels))


def _swap(nodes, name, new):
    return [new if n.name == name else n for n in nodes]


@pytest.mark.parametrize("name", PROVEN)
def test_oracle_is_proven(name):
    result = prove_equivalent(_oracle(name))
    assert isinstance(result, ProofResult)
    assert result.ok, result.reason
    assert result.seconds < 4.0  # target 2 s on 2 cores; slack for a loaded machine


def test_proof_is_independent_of_instantiation():
    """One proof per design: symbols stay egglog terms, and other fixed dims prove too."""
    g = _oracle("rmsnorm_linear")
    ctx = _Ctx(tuple(g.symbols))
    program_terms(g, ctx)
    got = str(sgraph_terms(g, ctx)["y"])
    assert 'Sym("F")' in got and 'Sym("G")' in got and 'Sym("BT")' in got
    assert prove_equivalent(_oracle("rmsnorm_linear", hidden=128, out=96)).ok


def test_results_are_cached():
    g = _oracle("swiglu")
    assert prove_equivalent(g) is prove_equivalent(g)


def test_a_proof_goes_on_while_its_egraph_grows_to_twice_its_rounds():
    """rmsnorm_linear's oracle is proven after 8 rounds of the schedule: given 6 it goes on and is
    proven, given 2 it stops at 4, unproven. A mutant stops where its e-graph stops growing."""
    g = _oracle("rmsnorm_linear")
    longer = prove_equivalent(g, iterations=6)
    assert longer.ok and 6 < longer.iterations <= 12, longer
    short = prove_equivalent(g, iterations=2)
    assert not short.ok and short.iterations == 4 and "within 4 iterations" in short.reason
    mutant = prove_equivalent(MUTANTS["qk_norm_eps_changed"](), iterations=ITERATIONS)
    assert not mutant.ok and mutant.iterations < 2 * ITERATIONS, mutant


def test_an_unproven_output_is_tried_once_more_with_the_terms_in_the_reverse_order(monkeypatch):
    """egglog's match order varies between processes, so a proof that stops unproven in one order
    is tried in the other (here rmsnorm_linear's oracle, proven after 8 rounds, gets 2 in the forward
    order, so only the reverse one, given 12, can prove it); a wrong design stays unproven in both."""
    from prism_serve.optimize.verify import proof

    real, orders = proof._saturated, []

    def uneven(g, iterations, order=proof.ORDERS[0]):
        orders.append(order)
        return real(g, iterations if order == "forward" else 12, order)

    monkeypatch.setattr(proof, "_saturated", uneven)
    monkeypatch.setattr(proof, "_CACHE", {})
    assert prove_equivalent(_oracle("rmsnorm_linear"), iterations=2).ok and orders == ["forward", "reverse"]
    orders.clear()
    assert not prove_equivalent(MUTANTS["qk_norm_eps_changed"](), iterations=2).ok
    assert orders == ["forward", "reverse"]


def test_proofs_run_egglog_on_one_thread_unless_told_otherwise():
    """egglog is deterministic on one thread only (`egglog_threads`): a fresh process that proves
    runs rayon's pool with one thread, and a RAYON_NUM_THREADS of its own is kept."""
    code = ("import os; from prism_serve.optimize.verify.proof import prove_equivalent; "
            "from prism_serve.optimize.workloads.oracles import oracle; "
            "from prism_serve.optimize.workloads.programs import WORKLOADS; "
            "assert prove_equivalent(oracle(WORKLOADS['rms_norm'].program(hidden=64))).ok; "
            "print(os.environ['RAYON_NUM_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    for given, want in ((None, "1"), ("3", "3")):
        run = subprocess.run([sys.executable, "-c", code], env=env | ({"RAYON_NUM_THREADS": given} if given else {}),
                             capture_output=True, text=True, timeout=300, check=True)
        assert run.stdout.split()[-1] == want


def _rms_div(g: SGraph) -> SGraph:
    """A correct variant of the rms_norm oracle written with a division: x / sqrt(var)."""
    return _edit(g, 0, lambda ns: _swap(ns, "r", node("r", "sqrt", "var")) and
                 _swap(_swap(ns, "r", node("r", "sqrt", "var")), "xr", node("xr", "div", "x", "r")))


def test_division_variant_is_proven():
    assert prove_equivalent(_rms_div(_oracle("rms_norm"))).ok


MUTANTS = {
    "swapped_div": lambda: _edit(_rms_div(_oracle("rms_norm")), 0,
                                 lambda ns: _swap(ns, "xr", node("xr", "div", "r", "x"))),
    "wrong_reduction_dim": lambda: _edit(_oracle("rms_norm"), 0, lambda ns: _swap(
        ns, "ms", node("ms", "mean", "sq", dim=0, keepdim=True))),
    "epsilon_changed": lambda: _edit(_oracle("rmsnorm_linear"), 0, lambda ns: _swap(
        ns, "eps", node("eps", "const", value=1e-5))),
    "epsilon_removed": lambda: _edit(_oracle("rms_norm"), 0, lambda ns: _swap(
        ns, "r", node("r", "rsqrt", "ms"))),
    # W_gate loaded transposed (its grid and loop maps exchanged) and multiplied without ^T:
    # tiles still fit because hidden == intermediate, but the kernel computes x @ W_gate.
    "wrong_map": lambda: _edit(_oracle("swiglu"), 0, lambda ns: _swap(_swap(
        ns, "wg", load("wg", "w_gate", (None, 1), fmap=0)), "a", node("a", "matmul", "x", "wg"))),
    # the loop range counted once more than the hidden size: sum over F parts read as mean
    "mean_for_sum_accumulator": lambda: _edit(_oracle("rmsnorm_linear"), 0, lambda ns: _swap(
        ns, "acc_ss", node("acc_ss", "accum", "ss", kind="mean"))),
    "off_by_one_range": lambda: _edit(_oracle("rmsnorm_linear"), 0, lambda ns: _swap(
        ns, "inv_d", node("inv_d", "const", value=1.0 / 65))),
    # online softmax without the rescale: the partials mix exp(s - m_i) of different running maxima
    "missing_rescale_acc": lambda: _edit(_oracle("attention"), 0, lambda ns: _swap(
        ns, "acc", node("acc", "accum", "pv", kind="sum"))),
    "missing_rescale_l": lambda: _edit(_oracle("qk_norm_attention"), 0, lambda ns: _swap(
        ns, "l", node("l", "accum", "rowsum", kind="sum"))),
    "swapped_combine_div": lambda: _edit(_oracle("attention"), 1, lambda ns: _swap(
        ns, "o", node("o", "div", "den", "num"))),
    "combine_max_sub_swapped": lambda: _edit(_oracle("attention"), 1, lambda ns: _swap(
        ns, "dm", node("dm", "sub", "mx", "mp"))),
    "qk_norm_eps_changed": lambda: _edit(_oracle("qk_norm_attention"), 0, lambda ns: _swap(
        ns, "k_eps", node("k_eps", "const", value=1e-5))),
    "swapped_gating": lambda: _edit(_oracle("swiglu"), 0, lambda ns: _swap(
        ns, "ga", node("ga", "silu", "acc_b"))),
    # Gemma: the norm scaled by w instead of 1 + w; GeGLU gated by SiLU instead of tanh GELU
    "gemma_offset_dropped": lambda: _edit(_oracle("gemma_rms_norm"), 0, lambda ns: _swap(
        ns, "y", node("y", "mul", "xr", "w"))),
    "gemma_fused_offset_dropped": lambda: _edit(_oracle("gemma_fused_add_rms_norm"), 0, lambda ns: _swap(
        ns, "y", node("y", "mul", "xr", "w"))),
    "geglu_gated_by_silu": lambda: _edit(_oracle("geglu"), 0, lambda ns: _swap(
        ns, "ga", node("ga", "silu", "acc_a"))),
    "gelu_on_up_half": lambda: _edit(_oracle("gelu_tanh_and_mul"), 0, lambda ns: _swap(
        ns, "g", node("g", "gelu_tanh", "up"))),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_rejected(mutant):
    g = MUTANTS[mutant]()
    result = prove_equivalent(g)
    assert not result.ok
    assert "not proven" in result.reason


# The numeric second line, on the same mutants: each is really wrong (so rejecting it is right).
# A changed or missing epsilon (1e-6 against a mean square near 0.1) moves fp32 results by ~5e-6,
# under the tolerance: only the proof sees it.
BELOW_TOLERANCE = {"epsilon_changed", "epsilon_removed", "qk_norm_eps_changed"}
LOOPED = {"B": 1, "H": 1, "S": 2, "F": 4}  # the rescale only matters when the loop runs more than once


@pytest.mark.parametrize("mutant", sorted(set(MUTANTS) - BELOW_TOLERANCE))
def test_mutant_is_numerically_wrong(mutant):
    g = MUTANTS[mutant]()
    values = LOOPED if "S" in g.symbols else default_assignment(g, target_tile=16)
    inst = instantiate(g, values, get_gpu("h100"))
    inputs = random_inputs(g.program, 5, seed=0)
    got = compile_instance(inst)(*inputs)
    errors = [max_rel_error(a, b) for a, b in zip(got, evaluate(g.program, inputs))]
    assert max(errors) > TOLERANCE["float32"], errors


def test_no_egraph_is_left_for_another_thread_to_drop(monkeypatch):
    """egglog's e-graph state sits in a reference cycle; unless released where it was built, the
    cyclic GC drops it on whatever thread runs next (warmup's progress display), where PyO3
    refuses ("EGraph is unsendable, but is being dropped on another thread")."""
    import gc
    import sys
    import threading

    from prism_serve.optimize.verify.proof import prove_equivalent
    from prism_serve.optimize.workloads import programs
    from prism_serve.optimize.workloads.oracles import oracle

    caught = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: caught.append(str(u.exc_value)))
    gc.collect()
    prove_equivalent(oracle(programs.rms_norm(88, "float32", 3e-6)))  # dims no other test caches
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()
    assert not [c for c in caught if "unsendable" in c], caught
