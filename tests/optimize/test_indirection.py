"""Indirection in the IR: gather, slice and concat against torch at awkward shapes (1 token,
non-power-of-two heads, int32 and int64 indices, the last row), their type rules, the typed
loader's one-line refusals, integer inputs in the reference, the rotary Programs against vLLM's
own formulas, and the placement rules of the three ops in block graphs."""

from __future__ import annotations

import json

import pytest
import torch

from prism_serve.errors import ProgramError, SGraphError
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.reference import as_torch_function, evaluate, index_bounds, random_inputs
from prism_serve.optimize.ir.schema import program_from_json
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph
from prism_serve.optimize.workloads.oracles import rotary as rotary_oracle
from prism_serve.optimize.workloads.programs import qk_norm_rotary, rotary

N = NUM_TOKENS


def _gather_program(index_dtype: str, rows: int = 13, heads: int = 3, cols: int = 6) -> Program:
    return Program("g", (
        node("table", "input", shape=(rows, heads, cols), dtype="float32"),
        node("idx", "input", shape=(N, 1), dtype=index_dtype),
        node("y", "gather", "table", "idx", dim=0),
    ), ("y",))


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_gather_picks_rows_by_index_including_the_last(index_dtype, tokens):
    prog = _gather_program(index_dtype)
    assert prog.types["y"].shape == (N, 1, 3, 6) and prog.types["y"].dtype == "float32"
    table = torch.randn(13, 3, 6)
    idx = torch.tensor([[12], [0], [12], [7], [3]][:tokens], dtype=getattr(torch, index_dtype))
    (got,) = evaluate(prog, [table, idx])
    assert got.shape == (tokens, 1, 3, 6)
    for t in range(tokens):
        assert torch.equal(got[t, 0], table[idx[t, 0].item()])
    (eager,) = as_torch_function(prog)(table, idx)  # the eager baseline takes the index as it is
    assert torch.equal(eager, got)


def test_gather_along_an_inner_dim_of_a_rank_two_index():
    prog = Program("g", (node("t", "input", shape=(5, 7), dtype="float16"),
                         node("i", "input", shape=(N, 2), dtype="int32"),
                         node("y", "gather", "t", "i", dim=-1)), ("y",))
    assert prog.types["y"].shape == (5, N, 2) and prog.types["y"].dtype == "float16"
    t, i = torch.randn(5, 7), torch.tensor([[6, 0], [3, 6], [1, 1]], dtype=torch.int32)
    (got,) = evaluate(prog, [t.half(), i])
    assert torch.equal(got, t.half().float()[:, i.long()])


@pytest.mark.parametrize("start,stop,step", [(0, 3, 1), (1, 7, 2), (0, 7, 2), (6, 7, 1), (2, 7, 3), (0, 7, 7)])
def test_slice_is_python_slicing_along_a_fixed_dim(start, stop, step):
    prog = Program("s", (node("x", "input", shape=(N, 3, 7), dtype="float32"),
                         node("y", "slice", "x", dim=2, start=start, stop=stop, step=step)), ("y",))
    x = torch.randn(1, 3, 7)
    (got,) = evaluate(prog, [x])
    assert torch.equal(got, x[:, :, start:stop:step])
    assert prog.types["y"].shape == (N, 3, len(range(start, stop, step)))


def test_slice_step_defaults_to_one():
    n = node("y", "slice", "x", dim=1, start=0, stop=2)
    assert n.attr("step") == 1


@pytest.mark.parametrize("interleave", [False, True])
def test_concat_joins_or_interleaves(interleave):
    prog = Program("c", (node("a", "input", shape=(N, 5, 3), dtype="float32"),
                         node("b", "input", shape=(N, 5, 3), dtype="float32"),
                         node("y", "concat", "a", "b", dim=2, interleave=interleave)), ("y",))
    a, b = torch.randn(1, 5, 3), torch.randn(1, 5, 3)
    (got,) = evaluate(prog, [a, b])
    assert prog.types["y"].shape == (N, 5, 6)
    if interleave:
        assert torch.equal(got[..., 0::2], a) and torch.equal(got[..., 1::2], b)
    else:
        assert torch.equal(got, torch.cat((a, b), 2))


def test_concat_of_unequal_parts_along_a_middle_dim():
    prog = Program("c", (node("a", "input", shape=(N, 2, 3), dtype="bfloat16"),
                         node("b", "input", shape=(N, 5, 3), dtype="bfloat16"),
                         node("y", "concat", "a", "b", dim=1)), ("y",))
    assert prog.types["y"].shape == (N, 7, 3) and prog.types["y"].dtype == "bfloat16"


X = node("x", "input", shape=(N, 3, 8), dtype="float32")
T = node("t", "input", shape=(16, 8), dtype="float32")
P = node("p", "input", shape=(N, 1), dtype="int64")


@pytest.mark.parametrize("nodes,message", [
    ([T, X, node("y", "gather", "t", "x", dim=0)], "node 'y': gather index 'x' is float32, not an integer tensor"),
    ([P, node("y", "exp", "p")], "node 'y': input 'p' is an integer tensor (int64), which only a gather's index"),
    ([P, T, node("y", "gather", "p", "t", dim=0)], "node 'y': input 'p' is an integer tensor (int64)"),  # swapped
    ([X, P, node("y", "gather", "x", "p", dim=0)], "node 'y': gather along dim 0 of table shape ('num_tokens', 3, 8), "
                                                   "which is num_tokens"),
    ([T, P, node("y", "gather", "t", "p", dim=2)], "node 'y': gather dim 2 out of range for table shape (16, 8)"),
    ([X, node("y", "slice", "x", dim=2, start=4, stop=9)], "node 'y': slice [4:9:1] of dim 2 (size 8) needs"),
    ([X, node("y", "slice", "x", dim=2, start=-1, stop=4)], "node 'y': slice [-1:4:1]"),
    ([X, node("y", "slice", "x", dim=2, start=4, stop=4)], "node 'y': slice [4:4:1]"),
    ([X, node("y", "slice", "x", dim=2, start=0, stop=4, step=0)], "node 'y': slice [0:4:0]"),
    ([X, node("y", "slice", "x", dim=0, start=0, stop=1)], "node 'y': slice along dim 0"),
    ([X, node("y", "slice", "x", dim=2, start=True, stop=4)], "node 'y': attribute 'start' must be int, got True"),
    ([X, node("h", "slice", "x", dim=2, start=0, stop=3), node("y", "concat", "x", "h", dim=1)],
     "node 'y': concat of shapes ('num_tokens', 3, 8) and ('num_tokens', 3, 3) along dim 1"),
    ([X, node("h", "slice", "x", dim=2, start=0, stop=3), node("y", "concat", "x", "h", dim=2, interleave=True)],
     "node 'y': interleaved concat of shapes"),
    ([X, node("y", "concat", "x", "x", dim=0)], "node 'y': concat along dim 0 of input shape ('num_tokens', 3, 8), which"),
    ([node("y", "input", shape=(4,), dtype="int32")], "program 'bad': output 'y' is an integer tensor (int32)"),
    ([node("y", "input", shape=(4,), dtype="int8")], "node 'y': dtype 'int8' is not one of"),
])
def test_malformed_indirection_names_the_node_in_one_line(nodes, message):
    with pytest.raises(ProgramError) as err:
        Program("bad", tuple(nodes), ("y",))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def _rotary_json() -> dict:
    return rotary(3, 1, 48, 24, 64, "float16").to_json()


def _node(doc: dict, name: str) -> dict:
    return next(n for n in doc["nodes"] if n["name"] == name)


def _set(name: str, key: str, value):
    def edit(doc: dict) -> None:
        _node(doc, name)["attrs"][key] = value
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set("q_x1", "start", -1), "node 'q_x1': attribute 'start' must be int in [0, 1048576], got -1"),
    (_set("q_x1", "stop", 2**21), "node 'q_x1': attribute 'stop' must be int in [1, 1048576]"),
    (_set("q_x1", "stop", 49), "node 'q_x1': slice [0:49:1] of dim 2 (size 48) needs"),
    (_set("q_x2", "start", 48), "node 'q_x2': slice [48:24:1]"),
    (_set("q_x1", "step", 0), "node 'q_x1': attribute 'step' must be int in [1, 1048576], got 0"),
    (_set("q_x1", "step", True), "node 'q_x1': attribute 'step' must be int in [1, 1048576], got True"),
    (_set("q_x1", "dim", 9), "node 'q_x1': attribute 'dim' must be int in [-8, 7], got 9"),
    (_set("q_x1", "start", 1.0), "node 'q_x1': attribute 'start' must be int in [0, 1048576], got 1.0"),
    (_set("q_rot", "interleave", 1), "node 'q_rot': attribute 'interleave' must be bool"),
    (_set("cs", "dim", 2), "node 'cs': gather dim 2 out of range for table shape (64, 24)"),
    (_set("positions", "dtype", "float32"), "node 'cs': gather index 'positions' is float32"),
    (_set("positions", "dtype", "uint8"), "node 'positions': dtype 'uint8' is not one of"),
    (_set("cos_sin_cache", "shape", [N, 24]), "node 'cs': gather along dim 0 of table shape ('num_tokens', 24)"),
    (_set("cs", "index", 3), "node 'cs': unknown attributes ['index'] for op gather"),
    (lambda doc: doc["outputs"].append("positions"), "program 'rotary': output 'positions' is an integer tensor"),
])
def test_the_loader_refuses_malformed_indirection_in_one_line(edit, message):
    doc = _rotary_json()
    edit(doc)
    with pytest.raises(ProgramError) as err:
        program_from_json(json.dumps(doc))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("build", [rotary, qk_norm_rotary])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_programs_round_trip_and_hash_their_attributes(build, style):
    prog = build(num_q_heads=3, num_kv_heads=1, head_dim=48, rotary_dim=24, max_position=64, style=style)
    again = program_from_json(json.dumps(prog.to_json()))
    assert again == prog and again.canonical_hash == prog.canonical_hash
    assert [n.name for n in prog.inputs][-2:] == ["positions", "cos_sin_cache"]
    assert prog.types["q_out"].shape == (N, 3, 48) and prog.types["k_out"].shape == (N, 1, 48)
    other = build(num_q_heads=3, num_kv_heads=1, head_dim=48, rotary_dim=24, max_position=64,
                  style="gptj" if style == "neox" else "neox")
    assert other.canonical_hash != prog.canonical_hash  # slice steps and interleave are semantic
    partial = build(num_q_heads=3, num_kv_heads=1, head_dim=48, rotary_dim=48, max_position=64, style=style)
    assert partial.canonical_hash != prog.canonical_hash


def test_rotary_refuses_a_bad_style_or_rotary_dim():
    with pytest.raises(ProgramError, match="style 'llama3' is not one of"):
        rotary(style="llama3")
    with pytest.raises(ProgramError, match="rotary_dim 7 must be even"):
        rotary(head_dim=64, rotary_dim=7)
    with pytest.raises(ProgramError, match="rotary_dim 66 must be even and in"):
        rotary(head_dim=64, rotary_dim=66)


def _vllm_rotary(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, style: str) -> torch.Tensor:
    """vLLM's RotaryEmbedding.forward_native (rotary_embedding/common.py), on a (T, H, D) tensor."""
    cos, sin = cache.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot, rest = x[..., :cache.shape[-1]], x[..., cache.shape[-1]:]
    if style == "neox":
        x1, x2 = torch.chunk(rot, 2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [((3, 1), 48, 48), ((5, 3), 64, 32), ((1, 1), 64, 64)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rotary_programs_compute_vllms_rotary(style, heads, head_dim, rotary_dim, tokens):
    max_position = 50
    positions = torch.tensor([[0], [49], [49], [3], [17], [0], [25]][:tokens])
    prog = rotary(*heads, head_dim, rotary_dim, max_position, "float32", style)
    q, k, _, cache = random_inputs(prog, tokens, seed=1)
    q_out, k_out = evaluate(prog, [q, k, positions, cache])
    torch.testing.assert_close(q_out, _vllm_rotary(q, positions, cache, style), rtol=0, atol=0)
    torch.testing.assert_close(k_out, _vllm_rotary(k, positions, cache, style), rtol=0, atol=0)
    normed = qk_norm_rotary(*heads, head_dim, rotary_dim, max_position, 1e-6, "float32", style)
    qw, kw = torch.randn(head_dim), torch.randn(head_dim)
    q_out, k_out = evaluate(normed, [q, k, qw, kw, positions, cache])
    torch.testing.assert_close(q_out, _vllm_rotary(_rms(q, qw, 1e-6), positions, cache, style))
    torch.testing.assert_close(k_out, _vllm_rotary(_rms(k, kw, 1e-6), positions, cache, style))


def test_random_integer_inputs_lie_in_the_gathered_rows_in_their_dtype():
    prog = rotary(3, 1, 48, 24, 5, "bfloat16")
    assert index_bounds(prog) == {"positions": 5}
    q, k, positions, cache = random_inputs(prog, 64, seed=0)
    assert positions.dtype == torch.int64 and positions.shape == (64, 1)
    assert positions.min() >= 0 and positions.max() == 4  # 64 draws of 5 values reach the last row
    assert q.dtype == cache.dtype == torch.bfloat16
    again = random_inputs(prog, 64, seed=0, dtype="float32")
    assert again[2].dtype == torch.int64 and again[0].dtype == torch.float32
    int32 = Program("g", (node("t", "input", shape=(9, 4), dtype="float32"),
                          node("u", "input", shape=(3, 4), dtype="float32"),
                          node("i", "input", shape=(N,), dtype="int32"),
                          node("a", "gather", "t", "i", dim=0), node("b", "gather", "u", "i", dim=0),
                          node("y", "add", "a", "b")), ("y",))
    assert index_bounds(int32) == {"i": 3}  # the smaller table bounds an index both gathers read
    (i,) = random_inputs(int32, 40, seed=3)[2:]
    assert i.dtype == torch.int32 and 0 <= i.min() and i.max() <= 2


# --- placement in block graphs (ir/sgraph.py) ------------------------------------------------------

def _oracle_with(edits: dict, rotary_dim: int = 8):
    """The rotary oracle's block graph with nodes replaced by name (a node -> a list of nodes)."""
    g = rotary_oracle(rotary(3, 1, 16, rotary_dim, 9, "float32"))
    (k,) = g.kernels
    nodes = [m for n in k.nodes for m in edits.get(n.name, [n])]
    return SGraph(g.name, g.program, g.intermediates, (BlockKernel(k.name, k.grid, k.forloop, tuple(nodes)),))


def _load(name, tensor, imap):
    return node(name, "load", tensor=tensor, imap=tuple(imap), fmap=None)


@pytest.mark.parametrize("edits,message", [
    ({"q_x1": [node("qq", "mul", "q", "q"), node("q_x1", "slice", "qq", dim=2, start=0, stop=4)]},
     "node 'q_x1': slice of 'qq', a computed value: a slice reads a load (or a window of one)"),
    ({"q": [_load("q", "q", (0, 2))]},
     "node 'q_x1': slice along dim 2 of 'q', which load 'q' partitions over the grid or the loop"),
    ({"cos": [node("cos", "gather", "cos_t", "cache", dim=0)]},
     "node 'cos': gather index 'cache' must be a load of an integer tensor"),
    ({"cos": [node("cs0", "gather", "cos_t", "pos", dim=0), node("cos", "gather", "cs0", "pos", dim=2)]},
     "node 'cos': gathers from 'cs0', which is already gathered"),
    ({"cos_t": [node("cos_t", "slice", "cache", dim=0, start=0, stop=4)]},
     "node 'cos': gathers along dim 0 of 'cos_sin_cache', which a slice narrowed"),
    ({"cos": [node("cs0", "gather", "cos_t", "pos", dim=0), node("cos", "slice", "cs0", dim=0, start=0, stop=1)]},
     "node 'cos': slice along dim 0 of 'cs0', a dim of its gather's index"),
    ({"st_q": [node("bad", "mul", "q_cat", "q_cat")]},
     "node 'bad': reads concat 'q_cat'; a concat feeds only stores and other concats"),
    ({"st_q": [node("st_q", "store", "pos", tensor="q_out", omap=(0, None))]},
     "node 'st_q': stores an integer tile (int64)"),
    ({"cache": [_load("cache", "cos_sin_cache", (None, 0))]},
     "node 'cos': gather along dim 0 of 'cos_sin_cache', which load 'cache' partitions over the grid"),
])
def test_misplaced_indirection_in_a_block_graph_is_a_named_sgraph_error(edits, message):
    with pytest.raises(SGraphError) as err:
        _oracle_with(edits)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_stored_concat_must_join_dims_the_store_leaves_whole():
    joined_heads = node("q_rot", "concat", "q_o1", "q_o2", dim=1)
    with pytest.raises(SGraphError, match="stores concat 'q_rot' along dim 1, which the store partitions"):
        _oracle_with({"q_rot": [joined_heads], "st_q": [node("st_q", "store", "q_rot", tensor="q_out", omap=(0, 1))]},
                     rotary_dim=16)


@pytest.mark.parametrize("build", [rotary, qk_norm_rotary])
def test_the_eager_baseline_runs_rotary_in_the_inputs_dtype(build):
    prog = build(num_q_heads=3, num_kv_heads=1, head_dim=48, rotary_dim=24, max_position=20, dtype="float16",
                 style="gptj")
    inputs = random_inputs(prog, 5, seed=2)
    eager = as_torch_function(prog)(*inputs)
    for got, ref in zip(eager, evaluate(prog, inputs)):
        assert got.dtype == torch.float16 and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3)
