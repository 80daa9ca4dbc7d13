"""Input iterators are enumerated, not derived: every (imap, fmap) of every kernel tensor is judged
once per block, the label-consistent ones survive, a transposed or mismatched read falls to the
abstract-expression rule at once, and a design that reads explicit maps builds them into its
sGraph (from untrusted JSON too), where the proof (and the numeric check) rejects the wrong ones."""

from __future__ import annotations

import itertools

import pytest

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.block import ALL, ROWS, TILES, BlockGenerator, input_iterators, own_iterators
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import BlockOp, BlockSpec, Design, build, iterator_maps, tensor_of
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.pipeline.stages import _check_numerics
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.optimize.workloads.programs import WORKLOADS

GRID, LOOP = ("num_tokens", "w0"), "x1"


def _square_rmsnorm_linear():
    """hidden = out: a dim read at the other label has the right extent, so only the abstract
    expression tells a transposed read of w from its own."""
    return WORKLOADS["rmsnorm_linear"].program(hidden=48, out=48, dtype="float32")


def _all_maps(rank: int, axes: int, walks: bool) -> list:
    """Independently: each grid axis partitions a distinct dim or none; the loop walks a dim no axis
    partitions, or none."""
    out = []
    for imap in itertools.product([None] + list(range(rank)), repeat=axes):
        used = [d for d in imap if d is not None]
        if len(used) == len(set(used)):
            out += [(imap, f) for f in [None] + ([d for d in range(rank) if d not in used] if walks else [])]
    return out


def test_every_map_of_every_tensor_is_judged_once_and_the_label_consistent_ones_survive():
    ctx = make_context(_square_rmsnorm_linear())
    own, others, counts = input_iterators(ctx.oracle, ctx.inputs, GRID, LOOP)
    expected = sum(len(_all_maps(len(v.labels), len(GRID), True)) for v in ctx.inputs.values())
    assert counts.iterators == counts.generated == expected
    assert counts.iterators_kept == len(own) + len(others) == 6
    assert counts.generated - counts.iterators_kept == sum(counts.pruned.values())
    assert counts.pruned["abstract_expression"] > 0 and counts.pruned["shape"] > 0
    assert [v.ref for v in own] == ["@x", "@g", "@w"]
    # whole rows first (each over the loop's label, which the Program reduces), each tensor's own maps
    assert [v.ref for v in others] == ["@x:whole", "@g:whole", "@w:whole"]
    assert {v.ref: v.labels for v in others}["@w:whole"] == ("w0", "x1:whole")
    assert all(v.stage == "pre" for v in others) and {v.ref: v.stage for v in own}["@w"] == "loop"


def test_a_transposed_or_replicated_weight_falls_to_the_abstract_expression_rule_and_is_offered_without_it():
    ctx = make_context(_square_rmsnorm_linear())
    w = {"@w": ctx.inputs["@w"]}
    transposed, replicated = "@w:-1/0", "@w:--/1"  # w0's axis on w's x1 dim; w0's axis replicates w
    _, kept, counts = input_iterators(ctx.oracle, w, GRID, LOOP)
    assert transposed not in {v.ref for v in kept} and replicated not in {v.ref for v in kept}
    assert counts.pruned["abstract_expression"] >= 2
    ctx.oracle.enabled = False
    _, offered, loose = input_iterators(ctx.oracle, w, GRID, LOOP)
    by_ref = {v.ref: v for v in offered}
    assert loose.iterators == counts.iterators and loose.pruned["abstract_expression"] == 0
    # read at each other's labels: a leaf of its own, which no term of the target has
    assert by_ref[transposed].labels == ("x1", "w0") and by_ref[transposed].expr != ctx.inputs["@w"].expr
    assert by_ref[replicated].labels == ("w0:whole", "x1") and by_ref[replicated].expr == ctx.inputs["@w"].expr


def test_the_tiles_walk_offers_own_maps_only_and_the_rows_walk_every_surviving_map():
    ctx = make_context(_square_rmsnorm_linear())

    def sources(iterators):
        gen = BlockGenerator(ctx.oracle, ctx.outputs, ctx.inputs, ctx.consts, GRID, LOOP, 8, frozenset(),
                             iterators=iterators)
        return [v.ref for v in gen.sources if v.ref.startswith("@")], gen.counts.iterators

    tiles, rows, every = sources(TILES), sources(ROWS), sources(ALL)
    assert tiles == (["@x", "@g", "@w"], 0)  # the ROWS walk judges (and counts) the maps
    assert rows == every and set(rows[0]) == {"@x", "@g", "@w", "@x:whole", "@g:whole", "@w:whole"}
    assert rows[1] > 0



@pytest.mark.parametrize("name", ["rmsnorm_linear", "rmsnorm_swiglu", "attention", "rotary"])
def test_the_own_iterators_derived_are_those_the_enumeration_keeps(name):
    """`own_iterators` (the TILES walk's, and a library op's over every label) derives each
    tensor's own maps instead of enumerating them all: the same iterators, with the rules on or off,
    over every kernel choice of the search and over the library grid."""
    ctx = make_context(WORKLOADS[name].program())
    gen = KernelGenerator(ctx, max_kernels=1, max_block_ops=8, max_grid=3)
    choices = gen.choices() + [(tuple(ctx.labels), None)]
    for enabled in (True, False):
        ctx.oracle.enabled = enabled
        for grid, loop in choices:
            own = input_iterators(ctx.oracle, ctx.inputs, grid, loop)[0]
            assert own_iterators(ctx.oracle, ctx.inputs, grid, loop) == own, (grid, loop, enabled)
            assert own, (grid, loop)


def _one_kernel(*ops) -> Design:
    block = tuple(BlockOp(f"b{i}", op, ins, attrs) for i, (op, ins, attrs) in enumerate(ops))
    return Design((BlockSpec(GRID, LOOP, block + (BlockOp("st", "store", (block[-1].name,), (("tensor", "y"),)),)),))


def _rmsnorm_linear_reading(w_ref: str, transpose_b: bool = True) -> Design:
    """rmsnorm_linear with the rms of the whole row before the loop, reading w through `w_ref`."""
    mean = (("dim", -1), ("keepdim", True))
    return _one_kernel(("square", ("@x:whole",), ()), ("mean", ("b0",), mean), ("add", ("b1", "#xn.eps"), ()),
                       ("rsqrt", ("b2",), ()), ("mul", ("@x", "b3"), ()), ("mul", ("@g", "b4"), ()),
                       ("matmul", ("b5", w_ref), (("transpose_b", transpose_b),)),
                       ("accum", ("b6",), (("kind", "sum"),)))


def test_a_design_builds_the_maps_its_iterators_name_and_the_proof_rejects_a_transposed_read():
    prog = _square_rmsnorm_linear()
    # w's tile read at (x1, w0): the matmul contracts its first dim, as the labels say
    right, transposed = _rmsnorm_linear_reading("@w"), _rmsnorm_linear_reading("@w:-1/0", transpose_b=False)
    loads = {n.attr("tensor") + ":" + n.name: (n.attr("imap"), n.attr("fmap"))
             for n in build(prog, transposed).kernels[0].loads}
    assert loads["w:ld_w_r1_0"] == ((None, 1), 0) and loads["x:ld_x_whole"] == ((0, None), None)
    assert {n.attr("imap") for n in build(prog, right).kernels[0].loads if n.attr("tensor") == "w"} == {(None, 0)}
    assert prove_equivalent(build(prog, right)).ok
    assert not prove_equivalent(build(prog, transposed)).ok
    assert not _check_numerics(prog, transposed, get_gpu("h100")).ok  # and it really computes x @ w, not x @ w^T
    again = Design.from_json(transposed.to_json())  # explicit maps travel through the typed loader
    assert again == transposed


@pytest.mark.parametrize("ref,why", [("@w:-1/", "JSON"), ("@w:-1/0;", "JSON"), ("@w:-12/0", "grid"),
                                     ("@w:-5/0", "rank"), ("@w:--/--", "JSON")])
def test_maps_that_do_not_fit_are_refused(ref, why):
    design = _rmsnorm_linear_reading(ref)
    if why == "JSON":
        with pytest.raises(SGraphError, match="must be a block value"):
            Design.from_json(design.to_json())
        return
    with pytest.raises(SGraphError, match=why):
        build(_square_rmsnorm_linear(), Design.from_json(design.to_json()))


def test_named_maps_are_the_shortest_name_of_their_maps():
    labels = ("num_tokens", "x1")
    assert tensor_of("@x:0-/-") == ("x", ":0-/-") and tensor_of("@x:whole") == ("x", ":whole")
    assert iterator_maps(":whole", labels, GRID, LOOP) == ((0, None), None)
    assert iterator_maps(":row", labels, GRID, LOOP) == ((0, None), None)
    assert iterator_maps("", labels, GRID, LOOP) == ((0, None), 1)
    assert iterator_maps(":0-/-", labels, GRID, LOOP) == ((0, None), None)
    with pytest.raises(SGraphError, match="without a for-loop"):
        iterator_maps(":0-/1", labels, GRID, None)
