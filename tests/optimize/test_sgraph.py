"""sGraph validation, symbolic tiles, instantiation checks and JSON errors."""

import pytest
import sympy

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.program import node
from prism_serve.optimize.ir.schema import sgraph_from_json
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel, GridAxis, SGraph, TensorDecl, sym
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import accum, load, oracle, store
from prism_serve.optimize.workloads.programs import WORKLOADS

H100, L40S = get_gpu("h100"), get_gpu("l40s")


def linear(**dims):
    return oracle(WORKLOADS["rmsnorm_linear"].program(**dims))


def test_tiles_are_expressions_of_the_symbols():
    g = linear(hidden=4096, out=1024)
    k = g.kernels[0]
    types = g.block_types(k)
    assert types["x"].shape == (sym("BT"), 4096 / sym("F"))
    assert types["w"].shape == (1024 / sym("G"), 4096 / sym("F"))
    assert types["acc_p"].shape == (sym("BT"), 1024 / sym("G"))
    assert set(g.symbols) == {"BT", "G", "F"}
    assert k.stages["x"] == "loop" and k.stages["acc_p"] == "post" and k.stages["y"] == "post"


def test_instantiation_checks_divisibility_and_assignment():
    g = linear(hidden=96, out=48)
    inst = instantiate(g, {"BT": 16, "G": 2, "F": 4}, H100)
    assert inst.tile(g.kernels[0], "w") == (24, 24)
    with pytest.raises(SGraphError, match="do not divide exactly"):
        instantiate(g, {"BT": 16, "G": 5, "F": 4}, H100)
    with pytest.raises(SGraphError, match=r"unassigned: \['F'\]"):
        instantiate(g, {"BT": 16, "G": 2}, H100)
    with pytest.raises(SGraphError, match="unknown symbols"):
        instantiate(g, {"BT": 16, "G": 2, "F": 4, "Z": 1}, H100)
    with pytest.raises(SGraphError, match="positive ints"):
        instantiate(g, {"BT": 16, "G": 0, "F": 4}, H100)


def test_instantiation_checks_shared_memory_of_the_named_gpu():
    g = linear(hidden=4096, out=4096)
    # 64 x 4096 fp16 weight tile: 512 KB, over every GPU's per-block limit.
    with pytest.raises(SGraphError, match="shared memory"):
        instantiate(g, {"BT": 16, "G": 64, "F": 1}, H100)
    fits_h100 = {"BT": 16, "G": 16, "F": 32}  # 256 x 128 fp16 double-buffered = 128 KB + the x tiles
    instantiate(g, fits_h100, H100)
    with pytest.raises(SGraphError, match="l40s allows 101376"):
        instantiate(g, fits_h100, L40S)


def test_instantiation_checks_registers():
    g = oracle(WORKLOADS["rms_norm"].program(hidden=8192))
    instantiate(g, {"BT": 4}, H100)
    with pytest.raises(SGraphError, match="registers"):
        instantiate(g, {"BT": 16}, H100)  # 16 x 8192 fp32 rows cannot stay in registers


def _kernel(nodes, grid=(GridAxis("BT", True),), forloop=None):
    return BlockKernel("k", grid, forloop, tuple(nodes))


def test_malformed_block_graphs_are_rejected_with_the_node_named():
    prog = WORKLOADS["silu_and_mul"].program(intermediate=64)
    ok = [load("gate", "gate", (0,)), load("up", "up", (0,)), node("g", "silu", "gate"),
          node("y", "mul", "g", "up"), store("out", "y", "y", (0,))]
    SGraph("ok", prog, (), (_kernel(ok),))
    cases = {
        "names unknown tensor 'nope'": [load("gate", "nope", (0,))] + ok[1:],
        "must name distinct dims": [load("gate", "gate", (5,))] + ok[1:],
        "can only partition the num_tokens dim": [load("gate", "gate", (1,))] + ok[1:],
        "input 'missing' is not an earlier node": ok[:3] + [node("y", "mul", "g", "missing")] + ok[4:],
        "neither an intermediate nor an output": ok[:4] + [store("out", "y", "gate", (0,))],
        "accumulator in a kernel without a for-loop": ok[:4] + [accum("a", "y", "sum"), store("out", "a", "y", (0,))],
    }
    for message, nodes in cases.items():
        with pytest.raises(SGraphError, match=message):
            SGraph("bad", prog, (), (_kernel(nodes),))
    scratch = (TensorDecl("t", (TOKENS, sympy.Integer(64)), "float32"),)
    with pytest.raises(SGraphError, match=r"no kernel writes outputs \['y'\]"):
        SGraph("bad", prog, scratch, (_kernel(ok[:4] + [store("out", "y", "t", (0,))]),))


def test_loop_rules():
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32)
    g = oracle(prog)
    k = g.kernels[0]
    no_accum = [n for n in k.nodes if n.op != "accum" and n.name not in ("ms", "var", "r", "y", "out")]
    with pytest.raises(SGraphError, match="stores a value of the loop body"):
        SGraph("bad", prog, (), (BlockKernel("k", k.grid, "F", tuple(no_accum + [store("o", "p", "y", (0, 1))])),))
    bad_rescale = list(k.nodes)
    bad_rescale[bad_rescale.index(k.by_name["acc_ss"])] = accum("acc_ss", "ss", "rescaled_sum", "acc_p")
    with pytest.raises(SGraphError, match="not a max accumulator"):
        SGraph("bad", prog, (), (BlockKernel("k", k.grid, "F", tuple(bad_rescale)),))


def test_token_axis_masks_the_last_block():
    g = oracle(WORKLOADS["rms_norm"].program(hidden=64))
    assert g.tensors["x"].shape == (TOKENS, sympy.Integer(64))
    inst = instantiate(g, {"BT": 16}, H100)
    assert inst.tile(g.kernels[0], "x") == (16, 64)


def test_json_errors_are_clear():
    g = oracle(WORKLOADS["rms_norm"].program(hidden=64))
    with pytest.raises(SGraphError, match="does not parse"):
        sgraph_from_json("{not json")
    data = g.to_json()
    data["sgraph_version"] = 99
    with pytest.raises(SGraphError, match="version 99"):
        sgraph_from_json(data)
    data = g.to_json()
    del data["kernels"][0]["grid"]
    with pytest.raises(SGraphError, match="malformed sGraph JSON"):
        sgraph_from_json(data)


def test_big_tiles_launch_more_warps_and_the_codegen_says_so():
    from prism_serve.optimize.codegen.render import render

    narrow = oracle(WORKLOADS["rms_norm"].program(hidden=1024))
    g = oracle(WORKLOADS["rms_norm"].program(hidden=8192))
    k = g.kernels[0]
    # 4 rows of 8192 fp16 and the weight over 4 warps: 160 loaded words, 40 16-byte vectors and 256
    # squares a thread, about 263 registers (resources.REG_WEIGHTS), over the 165 usable; 8 warps halve it
    small, big = instantiate(narrow, {"BT": 1}, H100), instantiate(g, {"BT": 4}, H100)
    assert small.warps(narrow.kernels[0]) == 4 < big.warps(k) <= H100.max_threads_per_block // 32
    assert f"num_warps={big.warps(k)})" in render(big)


def test_more_than_three_grid_axes_fold_onto_launch_dim_1():
    from prism_serve.optimize.ir.sgraph import launch_dims
    assert launch_dims(3) == ((0,), (1,), (2,))
    assert launch_dims(5) == ((0,), (1, 2, 3), (4,))
    prog = WORKLOADS["silu_and_mul"].program(intermediate=64)
    nodes = (load("gate", "gate", (1, None, 0, None)), node("y", "silu", "gate"),
             store("out", "y", "y", (1, None, 0, None)))
    with pytest.raises(SGraphError, match="token axis BT must be grid axis 0 or the last"):
        SGraph("folded", prog, (), (BlockKernel("k", (GridAxis("G"), GridAxis("BT", True), GridAxis("X"),
                                                       GridAxis("Y")), None, nodes),))
    ok = (load("gate", "gate", (0, 1, None, None)), node("y", "silu", "gate"),
          store("out", "y", "y", (0, 1, None, None)))
    g = SGraph("folded", prog, (), (BlockKernel("k", (GridAxis("BT", True), GridAxis("G"), GridAxis("X"),
                                                     GridAxis("Y")), None, ok),))
    instantiate(g, {"BT": 4, "G": 64, "X": 1023, "Y": 1}, H100)
    with pytest.raises(SGraphError, match="grid dim 1 = 65536 exceeds h100's limit 65535"):
        instantiate(g, {"BT": 4, "G": 64, "X": 1024, "Y": 1}, H100)  # G and X share launch dim 1


def _row_program():
    from prism_serve.optimize.ir.program import Program
    return Program("p", (node("x", "input", shape=("num_tokens", 8), dtype="float32"), node("two", "const", value=2.0),
                         node("t", "mul", "x", "x"), node("y", "add", "t", "x")), ("y",))


def test_a_kernel_stores_a_tensor_once_and_never_reads_what_it_writes():
    """Two stores of one tensor in a kernel race between blocks on a GPU (the interpreter runs blocks
    in order, and the proof sees the last store); so does a kernel that reads what it writes."""
    ax = (GridAxis("BT", over_tokens=True), GridAxis("G"))
    twice = BlockKernel("k", ax, None, (
        node("xr", "load", tensor="x", imap=(0, None), fmap=None), node("s1", "store", "xr", tensor="y", omap=(0, None)),
        node("xt", "load", tensor="x", imap=(0, 1), fmap=None), node("s2", "store", "xt", tensor="y", omap=(0, 1))))
    with pytest.raises(SGraphError, match="stores tensor 'y' twice"):
        SGraph("race", _row_program(), (), (twice,))
    t = TensorDecl("t", (TOKENS, sympy.Integer(8)), "float32")
    first = BlockKernel("k1", ax[:1], None, (node("a", "load", tensor="x", imap=(0,), fmap=None),
                                             node("b", "mul", "a", "a"), node("s", "store", "b", tensor="t", omap=(0,))))
    inplace = BlockKernel("k2", ax[:1], None, (node("a", "load", tensor="t", imap=(0,), fmap=None),
                                               node("s", "store", "a", tensor="t", omap=(0,)),
                                               node("x", "load", tensor="x", imap=(0,), fmap=None),
                                               node("y", "add", "a", "x"), node("o", "store", "y", tensor="y", omap=(0,))))
    with pytest.raises(SGraphError, match="loads and stores tensor 't'"):
        SGraph("inplace", _row_program(), (t,), (first, inplace))


def test_names_are_one_thing_each_also_as_generated_code_spells_them():
    ax = (GridAxis("BT", over_tokens=True),)
    square = (node("a", "load", tensor="x", imap=(0,), fmap=None), node("b", "mul", "a", "a"))
    add = (node("a", "load", tensor="x", imap=(0,), fmap=None), node("t", "load", tensor="t", imap=(0,), fmap=None),
           node("c", "add", "t", "a"), node("o", "store", "c", tensor="y", omap=(0,)))
    t = TensorDecl("t", (TOKENS, sympy.Integer(8)), "float32")
    k1 = BlockKernel("k", ax, None, square + (node("s", "store", "b", tensor="t", omap=(0,)),))
    with pytest.raises(SGraphError, match="kernel names 'k' and 'k' are the same name"):
        SGraph("dup", _row_program(), (t,), (k1, BlockKernel("k", ax, None, add)))
    with pytest.raises(SGraphError, match="kernel names 'k.a' and 'k_a' are the same name in generated code"):
        SGraph("dup", _row_program(), (t,), (BlockKernel("k.a", ax, None, k1.nodes), BlockKernel("k_a", ax, None, add)))
    shadow = TensorDecl("x", (TOKENS, sympy.Integer(8)), "float32")
    with pytest.raises(SGraphError, match="tensor names 'x' and 'x'"):
        SGraph("shadow", _row_program(), (shadow,), (BlockKernel("k1", ax, None, add),))
    SGraph("fine", _row_program(), (t,), (k1, BlockKernel("k2", ax, None, add)))
