"""Rotary embedding and QK-norm + rotary in the search (#37): each kind of wrong design (halves
swapped, cos and sin swapped, the wrong position, a gather on the wrong dim) is rejected, the test
saying by what; the generator reaches designs with the oracles' block graphs (cos / sin rows
gathered once per token block for q and k alike, the halves as windowed loads, the norm and the
rotation in one pass), over a token grid and over the oracles' grid, whose one head axis splits
q's heads and k's, which the proof and the numeric check accept."""

from __future__ import annotations

from collections import Counter

import pytest

from prism_serve.errors import PrismError
from prism_serve.optimize.generate.block import BlockGenerator
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import BlockOp, BlockSpec, Design, build, rebased
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.generate.windows import canonical
from prism_serve.optimize.ir.program import NUM_TOKENS, Node
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph
from prism_serve.optimize.pipeline.stages import verify_design
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.check import check_numerics
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.optimize.workloads import programs as P
from prism_serve.optimize.workloads.oracles import default_assignment, oracle

H100 = get_gpu("h100")


def _rotary(style: str = "neox", rotary_dim: int = 16):
    return P.rotary(3, 1, 16, rotary_dim, 32, "float32", style)


def _edit(g: SGraph, edit) -> SGraph:
    k = g.kernels[0]
    nodes = tuple(edit(n) for n in k.nodes)
    return SGraph(g.name + "_mutant", g.program, g.intermediates, (BlockKernel(k.name, k.grid, k.forloop, nodes),))


def _with(n: Node, **attrs) -> Node:
    return Node(n.name, n.op, n.inputs, tuple(sorted((dict(n.attrs) | attrs).items())))


def _swap_halves(n: Node) -> Node:
    """q's first half read where its second belongs and back (x1 and x2 exchanged)."""
    if n.name == "q_x1":
        return Node(n.name, n.op, n.inputs, _with(n, start=8, stop=16).attrs)
    if n.name == "q_x2":
        return Node(n.name, n.op, n.inputs, _with(n, start=0, stop=8).attrs)
    return n


def _swap_cos_sin(n: Node) -> Node:
    if n.op == "gather":
        return Node(n.name, n.op, ({"cos_t": "sin_t", "sin_t": "cos_t"}[n.inputs[0]], n.inputs[1]), n.attrs)
    return n


def _offset_window(n: Node) -> Node:
    """cos read one column off in each gathered row (the window of the cache starts at 1, not 0):
    the sGraph's rules admit no arithmetic on the position tile, so a wrong offset into the cache
    is a wrong window of its rows."""
    return _with(n, start=1, stop=9) if n.name == "cos_t" else n


def _numerically_wrong(g: SGraph) -> bool:
    inst = instantiate(g, default_assignment(g, target_tile=16), H100)
    return not check_numerics(inst, tokens=(1, 7), seed=0).ok


def test_the_oracles_pass_both_checks():
    for prog in (_rotary(), _rotary("gptj"), _rotary(rotary_dim=8)):
        g = oracle(prog)
        assert prove_equivalent(g).ok
        assert not _numerically_wrong(g)


@pytest.mark.parametrize("mutant", ["halves_swapped", "cos_sin_swapped", "offset_by_one"])
def test_a_wrong_rotary_is_rejected_by_the_proof_and_the_numeric_check(mutant):
    g = oracle(_rotary())
    bad = {"halves_swapped": lambda: _edit(g, _swap_halves), "cos_sin_swapped": lambda: _edit(g, _swap_cos_sin),
           "offset_by_one": lambda: _edit(g, _offset_window)}[mutant]()
    proof = prove_equivalent(bad)
    assert not proof.ok, "the proof accepted a wrong rotary"
    assert _numerically_wrong(bad), "the numeric check accepted a wrong rotary"


def test_a_gather_on_the_wrong_dim_is_rejected_by_the_type_rules():
    """Gathering cos / sin along the table's rotary dim (dim 1) types as (32, T, 1): no design of
    the Program can even be built around it, so it never reaches the proof; the proof's algebra
    keeps the two gathers apart as well (tests/optimize/test_indexing_algebra.py)."""
    g = oracle(_rotary())
    with pytest.raises(PrismError, match="node 'cos'"):
        _edit(g, lambda n: _with(n, dim=1) if n.op == "gather" else n)


def _one_kernel(prog, max_ops=None):
    """The first one-kernel design over a token grid that writes every output."""
    ctx = make_context(prog)
    ops = max_ops or KernelGenerator(ctx, max_kernels=1, max_block_ops=8, max_grid=3).alone_ops
    gen = BlockGenerator(ctx.oracle, ctx.outputs, ctx.inputs, ctx.consts, (NUM_TOKENS,), None, ops, frozenset(),
                         outputs_only=True, indexing=ctx.indexing)
    for c in gen.run():
        if set(c.outputs) == set(prog.outputs):
            stores = tuple(BlockOp(f"st{i}", "store", (v.ref,), (("tensor", o),))
                           for i, (v, o) in enumerate(zip(c.sinks, c.outputs)))
            return Design((BlockSpec((NUM_TOKENS,), None, c.ops + stores),))
    raise AssertionError("no one-kernel design reached")


def _block_ops(g: SGraph) -> Counter:
    """The block ops with their attributes (a slice's stop made canonical: 0:16:2 is 0:15:2)."""
    def attrs(n: Node) -> tuple:
        a = dict(n.attrs)
        if n.op == "slice":
            a["stop"] = canonical(a["start"], a["stop"], a["step"])[1]
        return tuple(sorted(a.items()))
    return Counter((n.op, attrs(n)) for k in g.kernels for n in k.nodes if n.op not in ("load", "store"))


@pytest.mark.parametrize("prog", [_rotary(), _rotary("gptj"), _rotary(rotary_dim=8),
                                  P.qk_norm_rotary(3, 1, 16, 16, 32, 1e-6, "float32")],
                         ids=["neox", "gptj", "partial", "qk_norm_neox"])
def test_the_generator_reaches_the_oracles_block_graph(prog):
    """The one-kernel design the generator reaches first holds the oracle's ops exactly: two
    windows of the cache, each gathered once and read by q's and k's rotations alike, q's and k's
    halves as windowed loads, the rotated halves concatenated into the stores; qk_norm_rotary's
    rsqrt of each head's mean square once, times each half (here over a token grid; the oracle's
    head axis, shared by q's and k's heads, below)."""
    design = _one_kernel(prog)
    g = build(prog, design)
    assert _block_ops(g) == _block_ops(oracle(prog))
    assert sum(n.op == "gather" for n in g.kernels[0].nodes) == 2
    proof, verdict, _ = verify_design(prog, design, H100)
    assert proof.ok, proof.reason
    assert verdict.ok, verdict.reasons


HEADS = NUM_TOKENS, "q1.k1"  # one grid axis over q's heads and k's heads


@pytest.mark.parametrize("name", ["rotary", "qk_norm_rotary"])
def test_the_generator_offers_one_grid_axis_over_q_and_k_heads(name):
    """q's heads and k's share no tensor and nothing reduces or gathers them, so a joint axis over
    both is a grid choice, and the first one; programs whose outputs share their labels (or that
    have one output) get none."""
    gen = KernelGenerator(make_context(P.WORKLOADS[name].program()), max_kernels=1, max_block_ops=8, max_grid=3)
    assert gen.choices()[0] == (HEADS, None)
    for other in ("fused_add_rms_norm", "attention", "rmsnorm_swiglu"):
        ctx = make_context(P.WORKLOADS[other].program())
        grids = [g for g, _ in KernelGenerator(ctx, max_kernels=1, max_block_ops=8, max_grid=3).choices()]
        assert not any("." in axis for g in grids for axis in g), other


@pytest.mark.parametrize("prog", [P.rotary(6, 2, 16, 8, 32, "float32", "gptj"),
                                  P.qk_norm_rotary(4, 2, 16, 16, 32, 1e-6, "float32")], ids=["gptj_partial", "qk_norm"])
def test_the_search_reaches_the_oracles_design_with_one_axis_over_q_and_k_heads(prog):
    """The oracle's design: one kernel per (token block, head block) whose block holds a slice of
    q's heads and of k's (6 and 2: the axis' blocks divide both), gathering each cos / sin row once
    for both; walked as its own subtree of the search, proven and checked (odd head counts per
    block included), and its stored form reloads through the typed loader."""
    gen = KernelGenerator(make_context(prog), max_kernels=1, max_block_ops=8, max_grid=3)
    design = next(gen.explore(1, (HEADS, None), gen.choices(), 400_000))
    assert [k.grid for k in design.kernels] == [HEADS]
    g = build(prog, design)
    k = g.kernels[0]
    axis = [a.symbol for a in k.grid if not a.over_tokens]
    assert len(k.grid) == 2 and len(axis) == 1
    loads = {n.attr("tensor"): n.attr("imap") for n in k.loads}
    assert loads["q"] == loads["k"] == (0, 1)  # both split their heads by the one axis
    assert loads["cos_sin_cache"][1] is None and loads["positions"][1] is None  # read once per head block
    assert _block_ops(g) == _block_ops(oracle(prog))
    assert sum(n.op == "gather" for n in k.nodes) == 2
    proof, verdict, _ = verify_design(prog, design, H100)
    assert proof.ok, proof.reason
    assert verdict.ok, verdict.reasons
    assert Design.from_json(design.to_json()) == design


def test_a_design_found_at_one_head_dim_rebuilds_at_another_with_its_windows_moved():
    """A searched design holds its halves' windows (0:8 and 8:16 of a 16-wide head); `rebased`
    moves them to another Program of the family's, slice by slice through the labels they take,
    and the moved design is proven and checked there. Where the family member slices differently
    (GPT-J's interleaved pairs), the moved design still does not build."""
    small, wide = _rotary(), P.rotary(3, 1, 32, 32, 64, "float32", "neox")
    design = _one_kernel(small)
    with pytest.raises(PrismError, match="no slice"):
        build(wide, design)
    moved = rebased(design, small, wide)
    assert rebased(design, small, small) == design
    windows = {(dict(o.attrs)["start"], dict(o.attrs)["stop"]) for o in moved.kernels[0].ops if o.op == "slice"}
    assert windows == {(0, 16), (16, 32)}
    proof, verdict, _ = verify_design(wide, moved, H100)
    assert proof.ok, proof.reason
    assert verdict.ok, verdict.reasons
    gptj = P.rotary(3, 1, 32, 32, 64, "float32", "gptj")
    with pytest.raises(PrismError, match="no slice"):
        build(gptj, rebased(design, small, gptj))


@pytest.mark.parametrize("axis", ["q1.q1", "num_tokens.q1", "q1.nope", "q1.q2"])
def test_a_stored_design_with_a_malformed_joint_axis_is_refused_in_one_line(axis):
    """A design from the registry is untrusted: its joint axis must join distinct labels of the
    Program, not the tokens, that no tensor holds together (q1 and q2 are both q's)."""
    prog = _rotary()
    raw = _one_kernel(prog).to_json()
    raw["kernels"][0]["grid"] = [NUM_TOKENS, axis]
    with pytest.raises(PrismError, match="joint grid axis") as err:
        build(prog, Design.from_json(raw))
    assert len(str(err.value).splitlines()) == 1
