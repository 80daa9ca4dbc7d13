"""The IR: construction checks, JSON round trip and the canonical hash."""

import json

import pytest

from prism_serve.errors import ProgramError
from prism_serve.optimize.ir.program import NUM_TOKENS, Program, node
from prism_serve.optimize.ir.schema import program_from_json
from prism_serve.optimize.workloads.programs import WORKLOADS

SMALL = {"attention": dict(kv_len=64, head_dim=32), "qk_norm_attention": dict(kv_len=64, head_dim=32)}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_json_round_trip(name):
    prog = WORKLOADS[name].program(**SMALL.get(name, {}))
    text = json.dumps(prog.to_json())
    again = program_from_json(text)
    assert again == prog and again.canonical_hash == prog.canonical_hash


def _swiglu(names=("x", "wg", "wu", "a", "b", "s", "y"), order=None):
    x, wg, wu, a, b, s, y = names
    nodes = [node(x, "input", shape=(NUM_TOKENS, 8), dtype="float16"),
             node(wg, "input", shape=(4, 8), dtype="float16"), node(wu, "input", shape=(4, 8), dtype="float16"),
             node(a, "matmul", x, wg, transpose_b=True), node(b, "matmul", x, wu, transpose_b=True),
             node(s, "silu", a), node(y, "mul", s, b)]
    if order:
        nodes = [nodes[i] for i in order]
    return Program("swiglu", tuple(nodes), (y,))


def test_hash_ignores_names_and_independent_order_but_not_semantics():
    base = _swiglu()
    assert _swiglu(names=("in0", "g", "u", "p", "q", "r", "out")).canonical_hash == base.canonical_hash
    assert _swiglu(order=[0, 1, 2, 4, 3, 5, 6]).canonical_hash == base.canonical_hash  # b before a
    swapped_inputs = _swiglu(order=[0, 2, 1, 3, 4, 5, 6])  # w_up declared before w_gate: new signature
    assert swapped_inputs.canonical_hash != base.canonical_hash
    rms = WORKLOADS["rms_norm"]
    assert rms.program(eps=1e-5).canonical_hash != rms.program(eps=1e-6).canonical_hash
    assert rms.program(dtype="bfloat16").canonical_hash != rms.program(dtype="float16").canonical_hash


def test_hash_is_pinned():
    """Registry keys are canonical hashes: a change here orphans every stored kernel (bump IR_VERSION)."""
    assert WORKLOADS["rms_norm"].program().canonical_hash == "3c6c13a8003e04ab5311215af77c9501"
    assert WORKLOADS["swiglu"].program().canonical_hash == "a253257720b7211f12e41386c2f3de12"


def _bad(nodes, outputs=("y",)):
    return Program("bad", tuple(nodes), tuple(outputs))


X = node("x", "input", shape=(NUM_TOKENS, 8), dtype="float32")


@pytest.mark.parametrize("nodes,message", [
    ([X, node("y", "add", "x", "z"), node("z", "exp", "y")], "node 'y': input 'z' is defined later"),
    ([X, node("y", "gelu", "x")], "node 'y': unsupported op 'gelu'"),
    ([X, node("w", "input", shape=(4, 8), dtype="float32"), node("y", "matmul", "x", "w")],
     "node 'y': matmul inner dims differ"),
    ([X, node("w", "input", shape=(3,), dtype="float32"), node("y", "add", "x", "w")], "node 'y': shapes"),
    ([X, node("y", "rms_norm", "x")], "node 'y': op rms_norm needs attribute 'eps'"),
    ([X, node("y", "sum", "x", dim="1")], "node 'y': attribute 'dim' must be int"),
    ([X, node("y", "sum", "x", dim=2)], "node 'y': reduction dim 2 out of range"),
    ([node("x", "input", shape=(4,), dtype="int8"), node("y", "exp", "x")], "node 'x': dtype 'int8'"),
    ([X, node("y", "exp", "x", "x")], "node 'y': op exp takes 1 inputs"),
    ([X, node("w", "input", shape=(8, 4), dtype="float32"), node("y", "matmul", "x", "w", precision="tf32")],
     r"node 'y': unknown attributes \['precision'\]"),  # a design's choice, never a Program's
    ([X, node("x", "exp", "x")], "node 'x': defined twice"),
])
def test_bad_programs_name_the_node(nodes, message):
    with pytest.raises(ProgramError, match=message):
        _bad(nodes)


def test_bad_json_is_a_clear_error():
    good = WORKLOADS["rms_norm"].program().to_json()
    with pytest.raises(ProgramError, match="does not parse"):
        program_from_json("{nope")
    with pytest.raises(ProgramError, match="lacks fields"):
        program_from_json({k: v for k, v in good.items() if k != "nodes"})
    with pytest.raises(ProgramError, match="ir_version 7"):
        program_from_json(good | {"ir_version": 7})
    with pytest.raises(ProgramError, match="node #0 must be an object"):
        program_from_json(good | {"nodes": [3]})
    with pytest.raises(ProgramError, match="output 'nope' is not a node"):
        program_from_json(good | {"outputs": ["nope"]})
    bad_dtype = json.loads(json.dumps(good))
    bad_dtype["nodes"][0]["attrs"]["dtype"] = "float64"
    with pytest.raises(ProgramError, match="node 'x': dtype 'float64'"):
        program_from_json(bad_dtype)
    bad_eps = json.loads(json.dumps(good))
    bad_eps["nodes"][2]["attrs"]["eps"] = "1e-6"
    with pytest.raises(ProgramError, match="node 'y': attribute 'eps' must be float"):
        program_from_json(bad_eps)
