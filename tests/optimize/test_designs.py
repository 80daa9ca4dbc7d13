"""Hand-built designs outside the old plan space: each is proven by the egglog proof and passes the
numeric check through Triton (random inputs at 1 and 7 tokens, zero rows, outlier channels) at
non-power-of-two sizes; mutants of them that the new space allows are rejected by the proof."""

from __future__ import annotations

import pytest

from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.ir.program import node
from prism_serve.optimize.ir.reference import TOLERANCE, evaluate, max_rel_error, random_inputs
from prism_serve.optimize.ir.sgraph import BlockKernel, GridAxis, SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.check import check_numerics
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.optimize.workloads import designs as D
from prism_serve.optimize.workloads.oracles import load, store
from prism_serve.optimize.workloads.programs import WORKLOADS

from .kernel_check import check_instance

H100 = get_gpu("h100")


def _norm(name: str, dtype: str = "float16", **dims):
    return WORKLOADS[name].program(**({"hidden": 48} | dims), dtype=dtype)


def _attn(dtype: str = "float16"):  # GQA: 3 q heads per kv head, 24 keys: nothing a power of two
    return WORKLOADS["attention"].program(batch=1, heads=6, kv_heads=2, kv_len=24, head_dim=24, dtype=dtype)


PROJ = {"BT": 16, "G": 2, "F": 3}
PROJ2 = {"BT2": 4, "G2": 4, "F2": 2}  # the second projection kernel of (c), tiled on its own
CASES = {  # design -> (builder, assignment)
    "b_rmsnorm_linear": (lambda: D.rms_then_projection(_norm("rmsnorm_linear", out=40)), PROJ | {"BR": 4, "FR": 2}),
    "b_rmsnorm_mlp": (lambda: D.rms_then_projection(_norm("rmsnorm_mlp", intermediate=40)), PROJ | {"BR": 4, "FR": 2}),
    "c_rmsnorm_mlp": (lambda: D.rms_recomputed(_norm("rmsnorm_mlp", intermediate=40)), PROJ | PROJ2),
    "c_rmsnorm_linear": (lambda: D.rms_recomputed(_norm("rmsnorm_linear", out=40)), PROJ),
    "a_gqa_decode": (lambda: D.gqa_decode(_attn()), {"B": 1, "H": 2, "Q": 3, "S": 2, "F": 3}),
    "d_divide_before_pv": (lambda: D.attention_whole_row(_attn(), divide_first=True), {"B": 1, "H": 2}),
    "d_divide_after_pv": (lambda: D.attention_whole_row(_attn(), divide_first=False), {"B": 1, "H": 2}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_design_is_proven_and_numerically_safe_in_fp16(name):
    build, values = CASES[name]
    g = build()
    proof = prove_equivalent(g)
    assert proof.ok, proof.reason
    verdict = check_numerics(instantiate(g, values, H100), seed=0)
    assert verdict.ok, verdict.reasons
    assert all(c.judged for c in verdict.cases)
    if g.program.name != "attention":
        assert {c.num_tokens for c in verdict.cases} == {1, 7}


def test_gqa_decode_runs_four_logical_axes_with_kv_loaded_once_per_group():
    g = D.gqa_decode(_attn())
    split = g.kernels[0]
    assert [a.symbol for a in split.grid] == ["B", "H", "Q", "S"]
    loads = {n.attr("tensor"): n for n in split.loads}
    assert loads["k"].attr("imap")[2] is None and loads["v"].attr("imap")[2] is None  # not per q block
    inst = instantiate(g, {"B": 1, "H": 2, "Q": 1, "S": 2, "F": 3}, H100)
    assert inst.tile(split, "q") == (1, 1, 3, 24)  # every q head of the kv head in one block
    check_instance(inst, 1, "float16")


def test_the_design_table_builds_each_for_its_workload():
    for name, (workload, build) in D.DESIGNS.items():
        prog = _attn() if workload == "attention" else _norm(workload, intermediate=40)
        assert build(prog).program == prog, name


def test_designs_are_distinct_from_each_other_and_the_oracles():
    from prism_serve.optimize.workloads.oracles import oracle
    hashes = {name: canonical_hash(build()) for name, (build, _) in CASES.items()}
    hashes |= {f"oracle_{p}": canonical_hash(oracle(prog)) for p, prog in
               (("linear", _norm("rmsnorm_linear", out=40)), ("mlp", _norm("rmsnorm_mlp", intermediate=40)),
                ("attention", _attn()))}
    assert len(set(hashes.values())) == len(hashes)


# --- mutants the new space allows: each is rejected by the proof, and really is wrong ------------

def _replace_kernel(g: SGraph, i: int, k: BlockKernel) -> SGraph:
    return SGraph(g.name + "_mutant", g.program, g.intermediates, g.kernels[:i] + (k,) + g.kernels[i + 1:])


def _replicated_partial_rms() -> SGraph:
    """The rms kernel splits the hidden dim over a second grid axis K but stores its partial 1/rms
    replicated over K: a combine (partition then reduce) is needed."""
    g = D.rms_then_projection(_norm("rmsnorm_linear", "float32", out=40))
    k = g.kernels[0]
    nodes = [load("x", "x", (0, 1), fmap=1) if n.name == "x" else
             store("st_r", "r", "rstd", (0, None)) if n.name == "st_r" else n for n in k.nodes]
    return _replace_kernel(g, 0, BlockKernel(k.name, (k.grid[0], GridAxis("K")), k.forloop, tuple(nodes)))


def _transposed_imap() -> SGraph:
    """W_up loaded with its grid and loop maps exchanged and multiplied without ^T: with a square
    W_up the tiles fit, but the kernel computes x @ W_up."""
    g = D.rms_then_projection(_norm("rmsnorm_mlp", "float32", intermediate=48))
    k = g.kernels[1]
    nodes = [load("w0", "w_up", (None, 1), fmap=0) if n.name == "w0" else
             node("p0", "matmul", "xn", "w0") if n.name == "p0" else n for n in k.nodes]
    return _replace_kernel(g, 1, BlockKernel(k.name, k.grid, k.forloop, tuple(nodes)))


def _recomputed_from_wrong_input() -> SGraph:
    """The gate kernel recomputes 1/rms from the norm weight instead of the row of x."""
    g = D.rms_recomputed(_norm("rmsnorm_mlp", "float32", intermediate=40))
    k = g.kernels[1]
    nodes = [load("row", "g", (None, None)) if n.name == "row" else n for n in k.nodes]
    return _replace_kernel(g, 1, BlockKernel(k.name, k.grid, k.forloop, tuple(nodes)))


MUTANTS = {
    "replicated_where_partition_needed": (_replicated_partial_rms, PROJ | {"BR": 4, "FR": 2, "K": 2}),
    "transposed_imap": (_transposed_imap, PROJ | {"BR": 4, "FR": 2}),
    "recomputed_producer_wrong_input": (_recomputed_from_wrong_input, PROJ | PROJ2),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_rejected_by_the_proof_and_numerically_wrong(name):
    build, values = MUTANTS[name]
    g = build()
    proof = prove_equivalent(g)
    assert not proof.ok and "not proven" in proof.reason
    inputs = random_inputs(g.program, 7, seed=0)
    got = compile_instance(instantiate(g, values, H100))(*inputs)
    errors = [max_rel_error(a, b) for a, b in zip(got, evaluate(g.program, inputs))]
    assert max(errors) > TOLERANCE["float32"], errors
