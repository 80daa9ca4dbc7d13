"""The cost model against hand-computed cases (H100: 3350 GB/s, 50 MB L2, 989.4 TFLOPS fp16)."""

import dataclasses

import pytest

from prism_serve.errors import SGraphError
from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.instantiate.cost import _time_us, block_kernel_cost, instance_cost, modeled_us
from prism_serve.optimize.instantiate.tune import rank
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.designs import on_tf32
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

H100 = get_gpu("h100")
MB_PER_US = 3350.0 * 1e3  # H100 DRAM bytes per us
L2_PER_US = MB_PER_US * 2.5
KiB, MiB = 1024, 2**20


def _linear(values, hidden=4096):
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=hidden))
    return instantiate(g, values, H100), g.kernels[0]


def test_memory_bound_row_op():
    """rms_norm, 4096 fp16 per row, 8192 tokens, one row per block: x read and y written once
    (64 MiB each), the 8 KiB weight read from DRAM once and from the L2 by the other 8191 blocks.
    16 KiB in flight per block over 600 ns is 27 GB/s an SM, 3.6 TB/s over 132: the peak."""
    g = oracle(WORKLOADS["rms_norm"].program())
    inst = instantiate(g, {"BT": 1}, H100)
    c = block_kernel_cost(inst, g.kernels[0], 8192, H100)
    assert c.dram_bytes == 128 * MiB + 8 * KiB and c.l2_bytes == 8191 * 8 * KiB
    assert c.bandwidth_gbs == 3350.0 and c.tensor_flops == 0
    assert c.time_us == pytest.approx((128 * MiB + 8 * KiB) / MB_PER_US + 8191 * 8 * KiB / L2_PER_US + 1.0)
    eager = block_kernel_cost(inst, g.kernels[0], 8192, H100, graphs=False)
    assert eager.time_us - c.time_us == pytest.approx(3.0 - 1.0)


def test_one_block_is_latency_bound():
    """One token in one block: 16 KiB in flight take 600 ns; the grid reaches 16384 / 600 B/ns."""
    g = oracle(WORKLOADS["rms_norm"].program())
    c = block_kernel_cost(instantiate(g, {"BT": 1}, H100), g.kernels[0], 1, H100)
    assert c.bandwidth_gbs == pytest.approx(16 * KiB / 600.0)
    assert c.time_us == pytest.approx(24 * KiB / (16 * KiB / 600.0) / 1e3 + 1.0)  # x, w, y over that


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_weight_streaming_gemm(num_tokens):
    """rmsnorm_linear 4096 -> 4096 fp16, K tiles of 256, N tiles of 32: 128 blocks, each with a
    16 KiB weight tile (plus x and g) in flight, 128 SMs busy: peak bandwidth. The 32 MiB weight
    is read once; x and g (8 KiB each per token row) are re-read by all 128 column blocks from
    the L2. Tensor cores run the 16-token dot; at 1 token codegen's choice decides."""
    inst, k = _linear({"BT": num_tokens, "F": 16, "G": 128})
    c = block_kernel_cost(inst, k, num_tokens, H100)
    x = num_tokens * 8 * KiB
    assert c.dram_bytes == 32 * MiB + x + 8 * KiB + x  # w, x, g, y
    assert c.l2_bytes == 127 * (x + 8 * KiB)
    assert c.bandwidth_gbs == 3350.0
    dot = "tl.dot(" in render(inst, interpret=False)
    flops = 2.0 * max(num_tokens, 16 if dot else 1) * 4096 * 4096
    assert (c.tensor_flops, c.fp32_flops >= flops) == ((flops, False) if dot else (0.0, True))
    assert dot == (num_tokens == 16 or inst.resources(k).mma_padded)
    mem = c.dram_bytes / MB_PER_US + c.l2_bytes / L2_PER_US
    assert c.time_us == pytest.approx(mem + 1.0)


def test_tf32_operands_run_at_half_the_tensor_core_rate():
    """The 16-token dot of test_weight_streaming_gemm on TF32 operands: the same bytes, its flops
    billed as TF32 work, which the H100 runs at 494.7 TFLOPS (half of fp16): 537 MFLOP take 1.09 us,
    under the memory time, so the kernel's time does not move; compute-bound, it doubles."""
    inst, k = _linear({"BT": 16, "F": 16, "G": 128})
    twin = instantiate(on_tf32(inst.sgraph), inst.values, H100)
    half, tf32 = block_kernel_cost(inst, k, 16, H100), block_kernel_cost(twin, twin.sgraph.kernels[0], 16, H100)
    flops = 2.0 * 16 * 4096 * 4096
    assert (half.tensor_flops, half.tf32_flops) == (flops, 0.0) and (tf32.tensor_flops, tf32.tf32_flops) == (0.0, flops)
    assert tf32.dram_bytes == half.dram_bytes and tf32.time_us == pytest.approx(half.time_us)
    assert _time_us(H100, 132, 1, 0.0, 0.0, 0.0, 0.0, 3350.0, tf32=1e9) == pytest.approx(1e9 / 494.7e6)
    assert _time_us(H100, 132, 1, 0.0, 0.0, 1e9, 0.0, 3350.0) == pytest.approx(1e9 / 989.4e6)


def test_l2_overflow_sends_rereads_to_dram():
    """64 tokens in blocks of 16: the 32 MiB weight is read by 4 token blocks. On an H100 a
    re-read set may use half the 50 MiB L2, so 25 / (32 MiB + x 512 KiB + g 8 KiB) of the
    re-reads hit; with a 200 MiB L2 all do."""
    inst, k = _linear({"BT": 16, "F": 16, "G": 128})
    w, x, g, y = 32 * MiB, 512 * KiB, 8 * KiB, 512 * KiB
    rereads = 3 * w + 127 * x + (4 * 128 - 1) * g
    big = dataclasses.replace(H100, l2_mb=200.0)
    fits = block_kernel_cost(inst, k, 64, big)
    assert fits.dram_bytes == w + x + g + y and fits.l2_bytes == rereads
    hit = 25 * MiB / (w + x + g)
    over = block_kernel_cost(inst, k, 64, H100)
    assert over.dram_bytes == pytest.approx(w + x + g + y + rereads * (1 - hit))
    assert over.l2_bytes == pytest.approx(rereads * hit)
    assert over.time_us > fits.time_us


def test_a_design_that_would_spill_is_infeasible():
    """16 rows of 8192 fp16 and the weight: 16 x 8192 / 2 = 65536 and 4096 words; over 1024
    threads 64 + 4 loaded words a thread (x 0.29), 16 + 1 16-byte vectors to address (x 2) and
    16 x 8192 / 1024 = 128 squares to sum (x 0.5), plus the base of 8.85: 127 registers, over the
    41 (65 % of 64) a thread of a 32-warp block may count on without spilling."""
    g = oracle(WORKLOADS["rms_norm"].program(hidden=8192))
    with pytest.raises(SGraphError, match="without spilling"):
        instantiate(g, {"BT": 16}, H100)
    r = instantiate(g, {"BT": 2}, H100).resources(g.kernels[0])
    assert r.regs_per_thread <= 255 // 8 * 8 and not r.spills


def test_ties_prefer_fewer_bytes_then_fewer_registers():
    ranked = rank(oracle(WORKLOADS["rmsnorm_linear"].program()), H100, 16)
    ties = 0
    for a, b in zip(ranked, ranked[1:]):
        if round(a.modeled_us, 6) == round(b.modeled_us, 6):
            ties += 1
            ba, bb = (sum(c.dram_bytes + c.l2_bytes for c in instance_cost(x.instance, 16, H100)) for x in (a, b))
            assert round(ba) <= round(bb)
            if round(ba) == round(bb):
                ra = [a.instance.resources(k) for k in a.instance.sgraph.kernels]
                rb = [b.instance.resources(k) for k in b.instance.sgraph.kernels]
                assert sum(r.regs_per_thread for r in ra) <= sum(r.regs_per_thread for r in rb)
    assert ties


def test_a_decode_tie_goes_to_the_tiling_that_reads_the_row_once():
    """rmsnorm_linear at tiny-llama's sizes and 8 tokens: dozens of tilings tie at one DRAM
    latency plus a launch. Before, the fewest registers won: 256 one-column blocks per token
    block, each re-reading and normalising the whole row (25x the bytes of the least)."""
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=128, out=256, dtype="bfloat16")
    ranked = rank(oracle(prog), H100, 8)
    ties = [c for c in ranked if round(c.modeled_us, 6) == round(ranked[0].modeled_us, 6)]
    moved = [sum(c.dram_bytes + c.l2_bytes for c in instance_cost(x.instance, 8, H100)) for x in ties]
    assert len(ties) > 10 and moved[0] == min(moved) and max(moved) > 10 * moved[0]


def test_graph_replay_is_cheaper_than_eager_launches():
    inst, _ = _linear({"BT": 16, "F": 16, "G": 128})
    assert modeled_us(inst, 16, H100, graphs=False) - modeled_us(inst, 16, H100) == pytest.approx(2.0)


def test_blocks_that_split_a_row_still_wait_one_dram_latency():
    """One token of rms_norm over 16 column blocks: each holds the 8 KiB row (re-read from the L2
    by 15 of them) and its 512-byte column tile of x and w; together they would pull the 24 KiB
    in 55 ns, but none finishes before its first loads return: 600 ns, then the launch. The two
    loads of x in a block count once in flight, as one DRAM request serves them."""
    from prism_serve.optimize.workloads.designs import rms_over_split_columns

    g = rms_over_split_columns(WORKLOADS["rms_norm"].program())
    c = block_kernel_cost(instantiate(g, {"BT": 1, "G": 16}, H100), g.kernels[0], 1, H100)
    assert c.blocks == 16 and c.dram_bytes == 24 * KiB
    assert c.bandwidth_gbs == pytest.approx(16 * (8 * KiB + 512) / 600.0)
    assert c.time_us == pytest.approx(0.6 + 1.0)


def test_a_loop_waits_one_dram_latency_per_two_pipelined_steps():
    """rmsnorm_linear 128 -> 256 at 16 tokens, one token row and 32 columns a block (128 blocks,
    one wave), the 128-wide K walked in 16 steps: the bytes (145 KiB from DRAM, 2 MiB of L2
    re-reads) take 0.9 us, but each block's loop waits for its loads 16 times, two iterations in
    flight (num_stages 3): 8 DRAM latencies. The same tiles in one step wait one."""
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=128, out=256))
    looped = block_kernel_cost(instantiate(g, {"BT": 1, "F": 16, "G": 8}, H100), g.kernels[0], 16, H100)
    assert looped.blocks == 128 and looped.dram_bytes / MB_PER_US + looped.l2_bytes / L2_PER_US < 0.9
    assert looped.time_us == pytest.approx(8 * 0.6 + 1.0)
    one_step = block_kernel_cost(instantiate(g, {"BT": 1, "F": 1, "G": 8}, H100), g.kernels[0], 16, H100)
    assert one_step.time_us == pytest.approx(0.6 + 1.0)
