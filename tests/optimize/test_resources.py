"""The resource model's MMA padding, as codegen emits it, checked against torch."""

import pytest

from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.target.resources import REG_WEIGHTS, blocked_per_thread, kernel_resources, mma_warps
from prism_serve.optimize.workloads.designs import on_tf32
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

from .kernel_check import check_instance

H100 = get_gpu("h100")


@pytest.mark.parametrize("name", ["rmsnorm_linear", "fused_add_rmsnorm_linear"])
def test_small_token_tiles_are_padded_to_the_mma_minimum(name):
    """Blocks of 4 tokens: a 4 x 64 x 32 broadcast product would outweigh 12 padded rows, so the
    token tile is padded to 16 masked rows and the matmul runs as tl.dot; the kernel matches
    torch at 1 and 7 tokens (7 leaves a partial second block), every output element written."""
    g = oracle(WORKLOADS[name].program(hidden=64, out=32, dtype="float32"))
    inst = instantiate(g, {"BT": 4, "F": 1, "G": 1}, H100)
    r = inst.resources(g.kernels[0])
    assert r.mma_padded and r.dots == ("p",)
    source = render(inst)
    assert "tl.dot(" in source and "tl.arange(0, 16) < 4" in source
    for num_tokens in (1, 7):
        check_instance(inst, num_tokens, "float32")


def test_no_padding_where_the_token_tile_already_fits_a_dot():
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32, dtype="float32"))
    inst = instantiate(g, {"BT": 16, "F": 1, "G": 1}, H100)
    assert not inst.resources(g.kernels[0]).mma_padded and "tl.arange(0, 16) < " not in render(inst)


@pytest.mark.parametrize("m, n, warps, split", [
    (16, 128, 8, (1, 8)),  # rmsnorm_mlp at 16 tokens: every warp takes 16 of the 128 columns
    (64, 64, 8, (2, 4)),
    (64, 64, 4, (2, 2)),
])
def test_mma_warps_split_the_tile_as_triton_does(m, n, warps, split):
    """The warpsPerCTA Triton 3.9 gave these dots (read from the TTGIR of the compiled kernels)."""
    assert mma_warps(m, n, warps) == split


def test_register_terms_of_the_two_dot_kernel():
    """rmsnorm_mlp (fp16, hidden 4096) at BT=16, F=32, G=32 on 8 warps (256 threads), by hand:
    x is 16 x 128 (4096 B), g 128 (256 B), each weight 128 x 128 (32768 B), all loaded in a
    32-step loop, so the loop is pipelined. Addresses: 4096 / 16 / 256 = 1, g 1, weights 8 + 8 = 18
    vectors a thread. g moves 1 byte a thread, under cp.async's 4, so it alone is loaded into
    registers: 64 words over 256 threads, 1 each. The two dots are 16 x 128 x 128: Triton puts the
    8 warps along N (16 x 16 each), 16 x 16 / 32 = 8 accumulator registers per dot. Their shared
    left operand x * g is computed from x (g is a row, smaller): 2 values x 16 rows x 128 columns
    / 32 lanes = 128 fp32 elements, counted once. The row sum of x^2 folds x in from its shared-memory
    stage (no reduction input held); its accumulator is 16 x 1, 1 a thread."""
    g = oracle(WORKLOADS["rmsnorm_mlp"].program())
    (k,) = g.kernels
    r = kernel_resources(g, k, {"BT": 16, "F": 32, "G": 32})
    assert r.dots == ("u", "v") and not r.mma_padded
    assert r.demand.terms(8) == {"base": 1, "pipeline": 1, "addresses": 18, "loads": 1, "dot_accumulators": 16,
                                 "accumulators": 1, "operand_loads": 0, "operand_chains": 128, "reduced": 0,
                                 "product_operands": 0, "tf32_operands": 0}
    assert r.demand.per_thread(8) == pytest.approx(sum(REG_WEIGHTS[t] * v for t, v in r.demand.terms(8).items()))


def test_tf32_operands_add_their_fp32_window_once():
    """The same kernel on TF32 operands: its terms are the half kernel's, plus the left operand's
    16 rows a warp holds over 128 columns (all of K) in fp32, a 32nd per thread: 64, counted once
    for the two dots that share it."""
    g = oracle(WORKLOADS["rmsnorm_mlp"].program())
    half = kernel_resources(g, g.kernels[0], {"BT": 16, "F": 32, "G": 32}).demand.terms(8)
    tf32 = on_tf32(g)
    terms = kernel_resources(tf32, tf32.kernels[0], {"BT": 16, "F": 32, "G": 32}).demand.terms(8)
    assert terms == half | {"tf32_operands": 64}


def test_a_plain_load_operand_streams_and_a_one_step_loop_is_not_pipelined():
    """swiglu's left operand is x itself: Triton's repM x 4 x repK registers (16 x 128 / 64 = 32 at
    BT=16, F=32, 8 warps), not a computed chain. With F=1 the loop has one step: nothing is
    pipelined, every tile is loaded into registers."""
    g = oracle(WORKLOADS["swiglu"].program())
    (k,) = g.kernels
    t = kernel_resources(g, k, {"BT": 16, "F": 32, "G": 32}).demand.terms(8)
    assert t["operand_loads"] == 32 and t["operand_chains"] == 0 and t["pipeline"] == 1
    assert t["loads"] == 0  # x, w_gate and w_up all move at least 4 bytes a thread
    one = kernel_resources(g, k, {"BT": 16, "F": 1, "G": 512}).demand.terms(8)
    assert one["pipeline"] == 0 and one["loads"] > 0


def test_broadcast_product_operands_in_the_default_blocked_layout():
    """Decode attention's q . k^T product (1 x 128 x 16) over 4 warps: the 32 lanes take the 16
    keys and 2 of the 128 head dims, the 4 warps 4 more head dims, so a thread holds 128 / 8 = 16
    head dims of one key: 16 q values and 16 k values in the product's layout."""
    assert blocked_per_thread((1, 128, 16), 4) == (1, 16, 1)
    assert blocked_per_thread((1, 16, 128), 4) == (1, 16, 1)  # e . v: lanes and warps along the 128
    assert blocked_per_thread((2, 2, 2), 4) == (1, 1, 1)  # a tile smaller than a warp is replicated


def test_a_chain_fed_by_a_load_too_narrow_for_cp_async_holds_its_whole_k():
    """rmsnorm_linear (fp16, hidden 4096) at BT=32, F=16, G=32: the 256 weights of g move 2 bytes
    per thread on 8 warps, under cp.async's 4, so g is loaded into registers and the x * g chain
    (2 values, 32 rows a warp) is live over all K = 256 columns: 2 x 32 x 256 / 32 = 512. On 4
    warps g moves 4 bytes a thread, is staged, and the chain is formed 128 columns at a time: 256.
    (ptxas: 243 and 179 registers on sm_80, bench/results/static-fit-sample-2026-12-03.jsonl.)"""
    g = oracle(WORKLOADS["rmsnorm_linear"].program())
    (k,) = g.kernels
    demand = kernel_resources(g, k, {"BT": 32, "F": 16, "G": 32}).demand
    assert demand.terms(8)["operand_chains"] == 512 and demand.terms(8)["loads"] == 1
    assert demand.terms(4)["operand_chains"] == 256 and demand.terms(4)["loads"] == 0
