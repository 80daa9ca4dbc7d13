"""Rotary in Triton, run by the interpreter against the torch reference: the hand-built oracles
(`oracles.rotary`, `oracles.qk_norm_rotary`: neox and GPT-J, full and partial rotary_dim, odd
head counts, 1 and 7 tokens, positions 0 and max_position - 1, repeated and shuffled, bf16 and
fp16), library kernels of gather, slice and concat, and the numeric check's inputs for them."""

from __future__ import annotations

import re

import pytest
import torch

from prism_serve.optimize.codegen.render import compile_instance, render
from prism_serve.optimize.ir.program import Node, Program, node
from prism_serve.optimize.ir.reference import TOLERANCE, evaluate, max_rel_error, random_inputs
from prism_serve.optimize.ir.sgraph import BlockKernel, LibraryKernel, SGraph, TensorDecl, to_expr
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.check import _edge_indices, _repeated_indices, check_numerics, small_program
from prism_serve.optimize.workloads import oracles
from prism_serve.optimize.workloads.programs import qk_norm_rotary, rotary

MAX_POSITION = 40
POSITIONS = {1: [MAX_POSITION - 1], 7: [0, MAX_POSITION - 1, 5, MAX_POSITION - 1, 0, 17, 5]}


def _program(kind: str, heads: tuple[int, int], head_dim: int, rotary_dim: int, dtype: str, style: str) -> Program:
    if kind == "rotary":
        return rotary(*heads, head_dim, rotary_dim, MAX_POSITION, dtype, style)
    return qk_norm_rotary(*heads, head_dim, rotary_dim, MAX_POSITION, 1e-6, dtype, style)


def _inputs(prog: Program, tokens: int, seed: int) -> list[torch.Tensor]:
    inputs = random_inputs(prog, tokens, seed=seed)
    at = [n.name for n in prog.inputs].index("positions")
    inputs[at] = torch.tensor(POSITIONS[tokens]).reshape(tokens, 1)
    return inputs


def _check(inst, prog: Program, dtype: str) -> None:
    run = compile_instance(inst)
    for tokens in (1, 7):
        inputs = _inputs(prog, tokens, seed=tokens)
        got = run(*inputs)
        for name, g, ref in zip(prog.outputs, got, evaluate(prog, inputs)):
            assert g.dtype == inputs[0].dtype and g.shape == ref.shape, name
            assert max_rel_error(g, ref) <= TOLERANCE[dtype], (name, tokens, max_rel_error(g, ref))


@pytest.mark.parametrize("kind", ["rotary", "qk_norm_rotary"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(48, 48), (64, 32)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_oracle_matches_the_reference_at_awkward_shapes(kind, style, head_dim, rotary_dim, dtype):
    prog = _program(kind, (3, 1), head_dim, rotary_dim, dtype, style)
    inst = instantiate(oracles.oracle(prog), {"BT": 4, "HB": 1}, get_gpu("h100"))
    _check(inst, prog, dtype)


@pytest.mark.parametrize("kind", ["rotary", "qk_norm_rotary"])
def test_oracle_over_head_blocks_and_one_token_block(kind):
    """Two head blocks (q's 4 heads two per block, k's 2 one per block); 8 tokens in a block."""
    prog = _program(kind, (4, 2), 64, 32, "float16", "gptj")
    inst = instantiate(oracles.oracle(prog), {"BT": 8, "HB": 2}, get_gpu("h100"))
    _check(inst, prog, "float16")


@pytest.mark.parametrize("kind", ["rotary", "qk_norm_rotary"])
def test_oracle_source_loads_each_cos_sin_row_once_and_stores_parts_at_their_offsets(kind):
    prog = _program(kind, (3, 1), 64, 32, "float16", "neox")
    source = render(instantiate(oracles.oracle(prog), {"BT": 4, "HB": 1}, get_gpu("h100")))
    # cos and sin: one indexed load each, by the position tile, shared by q and k
    cache_loads = re.findall(r"= tl\.load\(cos_sin_cache_ptr \+ v_pos\[:, :, None\]\.to\(tl\.int64\) \* "
                             r"cos_sin_cache_s0 \+ offs_(\w+)_2", source)
    assert cache_loads == ["cos", "sin"]
    assert "v_pos = tl.load(positions_ptr" in source and ", other=0)" in source  # an integer tile
    for x in ("q", "k"):  # the two rotated halves and the pass-through part, each stored at its offset
        offsets = re.findall(rf"offs_st_{x}_\w+_2 = (\d+ \+ )?tl\.arange", source)
        assert offsets == ["", "16 + ", "32 + "], offsets
        assert len(re.findall(rf"tl\.store\({x}_out_ptr", source)) == 3
    assert "torch.cat" not in source and "tl.reshape" not in source


def test_gptj_stores_the_rotated_halves_interleaved():
    prog = _program("rotary", (3, 1), 48, 48, "float16", "gptj")
    source = render(instantiate(oracles.oracle(prog), {"BT": 4, "HB": 1}, get_gpu("h100")))
    assert re.findall(r"offs_st_q_\w+_2 = (.*)", source) == ["2 * tl.arange(0, 32)", "1 + 2 * tl.arange(0, 32)"]
    assert re.findall(r"offs_q_x\d_2 = (.*)", source) == ["2 * tl.arange(0, 32)", "1 + 2 * tl.arange(0, 32)"]


def _library_sgraph(prog: Program) -> SGraph:
    """Every op of `prog` its own library kernel (torch), through declared intermediates."""
    inter = tuple(TensorDecl(n.name, tuple(to_expr(d) for d in prog.types[n.name].shape), prog.types[n.name].dtype)
                  for n in prog.nodes if n.op != "input" and n.name not in prog.outputs)
    return SGraph(f"{prog.name}_library", prog, inter,
                  tuple(LibraryKernel(n) for n in prog.nodes if n.op != "input"))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("kind", ["rotary", "qk_norm_rotary"])
def test_library_kernels_of_gather_slice_and_concat(kind, style):
    prog = _program(kind, (3, 1), 48, 24, "float32", style)
    inst = instantiate(_library_sgraph(prog), {}, get_gpu("h100"))
    source = render(inst)
    assert "v_cs = v_cos_sin_cache.index_select(0, v_positions.reshape(-1))" in source
    assert ("torch.stack((" in source) == (style == "gptj") and "torch.cat((" in source
    _check(inst, prog, "float32")


# --- the numeric check's inputs (verify/check.py) --------------------------------------------------

def _rotary_instance(dtype: str = "bfloat16", style: str = "gptj", edit=None):
    prog = _program("rotary", (3, 1), 64, 32, dtype, style)
    g = oracles.oracle(prog)
    if edit:
        (k,) = g.kernels
        g = SGraph(g.name, prog, (), (BlockKernel(k.name, k.grid, None, tuple(edit(n) for n in k.nodes)),))
    return instantiate(g, {"BT": 4, "HB": 1}, get_gpu("h100"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_numeric_check_passes_the_oracle_on_edge_and_repeated_positions(dtype):
    verdict = check_numerics(_rotary_instance(dtype), seed=0)
    assert verdict.ok, verdict.reasons
    names = [c.name for c in verdict.cases]
    assert names[0].startswith("outlier") and "indices at the last and first rows, 1 token" in names
    assert names[-2:] == ["indices at the last and first rows, 7 tokens", "repeated indices in random order, 7 tokens"]
    assert check_numerics(_rotary_instance(dtype), "float32", seed=0).ok  # positions stay int64 when retyped


def test_the_numeric_check_rejects_cos_and_sin_swapped():
    swap = {"cos": "sin", "sin": "cos"}

    def edit(n: Node) -> Node:
        return Node(n.name, n.op, tuple(swap.get(i, i) for i in n.inputs), n.attrs) if n.op == "mul" else n

    verdict = check_numerics(_rotary_instance(edit=edit), seed=0)
    assert not verdict.ok and "over the tolerance" in verdict.reasons[0], verdict.reasons


def test_edge_and_repeated_indices_stay_in_the_table():
    prog = _program("qk_norm_rotary", (3, 1), 64, 32, "float16", "neox")
    at = [n.name for n in prog.inputs].index("positions")
    one = _edge_indices(prog, random_inputs(prog, 1, seed=0))[at]
    assert one.tolist() == [[MAX_POSITION - 1]] and one.dtype == torch.int64
    seven = _edge_indices(prog, random_inputs(prog, 7, seed=0))[at]
    assert seven.reshape(-1).tolist() == [MAX_POSITION - 1, 0] * 3 + [MAX_POSITION - 1]
    inputs = random_inputs(prog, 30, seed=1)
    again = _repeated_indices(prog, inputs, torch.Generator().manual_seed(0))
    values = again[at].reshape(-1)
    assert values.numel() == 30 and len(set(values.tolist())) <= 10
    assert set(values.tolist()) <= set(inputs[at].reshape(-1).tolist())
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(again, inputs)) if i != at)


@pytest.mark.parametrize("kind", ["rotary", "qk_norm_rotary"])
def test_the_small_program_keeps_the_dims_slices_cut(kind):
    full = rotary() if kind == "rotary" else qk_norm_rotary()
    small = small_program(full)  # a Program: its slices still type-check
    assert small.by_name["cos_sin_cache"].attr("shape") == (48, 128)  # fewer rows; the columns the slices read
    assert small.by_name["q"].attr("shape") == ("num_tokens", 32, 128)
    partial = small_program(rotary(rotary_dim=64))
    assert partial.by_name["cos_sin_cache"].attr("shape") == (48, 64) and partial.types["q_out"].shape[-1] == 128


def test_a_block_graph_in_the_programs_own_order_renders():
    """Gather the whole cache row, then slice cos and sin from it (each still one indexed load),
    one token axis only (3 and 2 heads padded to 4 and 2), the outer concat along dim -1."""
    prog = rotary(3, 2, 40, 20, MAX_POSITION, "float32", "neox")
    nodes = [oracles.load("pos", "positions", (0,)), oracles.load("cache", "cos_sin_cache", (None,)),
             node("cs", "gather", "cache", "pos", dim=0),
             node("cos", "slice", "cs", dim=2, start=0, stop=10), node("sin", "slice", "cs", dim=2, start=10, stop=20)]
    for x in ("q", "k"):
        nodes += [oracles.load(x, x, (0,)), node(f"{x}_x1", "slice", x, dim=2, start=0, stop=10),
                  node(f"{x}_x2", "slice", x, dim=2, start=10, stop=20),
                  node(f"{x}_pass", "slice", x, dim=2, start=20, stop=40)]
        nodes += oracles._rotate(x, f"{x}_x1", f"{x}_x2", f"{x}_pass", False, f"{x}_out")[:-2]
        nodes += [node(f"{x}_cat", "concat", f"{x}_rot", f"{x}_pass", dim=-1),
                  oracles.store(f"st_{x}", f"{x}_cat", f"{x}_out", (0,))]
    g = SGraph("in_order", prog, (), (BlockKernel("rotary", (oracles.GridAxis("BT", True),), None, tuple(nodes)),))
    inst = instantiate(g, {"BT": 2}, get_gpu("h100"))
    assert len(re.findall(r"= tl\.load\(cos_sin_cache_ptr", render(inst))) == 2  # cs itself is never loaded
    _check(inst, prog, "float32")


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_an_indexed_load_by_an_integer_tile_of_either_width(index_dtype):
    """A gather of whole rows of a rank-3 table by a (tokens, 1) index, stored as is; the last row
    and repeated rows, 1 and 7 tokens (a masked token block of 4)."""
    prog = Program("g", (node("table", "input", shape=(13, 3, 6), dtype="float16"),
                         node("idx", "input", shape=("num_tokens", 1), dtype=index_dtype),
                         node("y", "gather", "table", "idx", dim=0)), ("y",))
    nodes = (oracles.load("t", "table", (None,)), oracles.load("i", "idx", (0,)),
             node("rows", "gather", "t", "i", dim=0), oracles.store("st", "rows", "y", (0,)))
    g = SGraph("gathered", prog, (), (BlockKernel("gather", (oracles.GridAxis("BT", True),), None, nodes),))
    run = compile_instance(instantiate(g, {"BT": 4}, get_gpu("h100")))
    table = torch.randn(13, 3, 6).half()
    for rows in ([12], [12, 0, 12, 5, 5, 3, 0]):
        idx = torch.tensor(rows, dtype=getattr(torch, index_dtype)).reshape(-1, 1)
        (got,) = run(table, idx)
        assert torch.equal(got, table[idx.long().reshape(-1)].reshape(len(rows), 1, 3, 6))
