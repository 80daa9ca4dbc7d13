"""The routed experts of a mixture-of-experts layer (#41): the `moe_experts` Program computes what
vLLM's own CPU fused MoE computes on the same weights and routing (an expert no token chooses,
one every token chooses, 1 token and an odd count); the search reaches its decode design (one
kernel per token block that loops over the token's top-k choices, gathering only the chosen
experts' rows), which the proof and the numeric check accept; and wrong designs, of that one and
of the two-kernel design the plugin serves (`oracles._moe_experts`, proven and checked where
`seed` stores it and in `test_oracles`), are rejected by both, the test saying which."""

from __future__ import annotations

import pytest
import torch

from prism_serve.baseline import vllm_modeled_us
from prism_serve.errors import ProgramError, SGraphError
from prism_serve.optimize.generate.context import make_context
from prism_serve.optimize.generate.design import BlockSpec, Design, build
from prism_serve.optimize.generate.kernel import KernelGenerator
from prism_serve.optimize.ir.program import NUM_TOKENS, Node
from prism_serve.optimize.ir.reference import evaluate, random_inputs
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph
from prism_serve.optimize.instantiate.tune import symbol_choices
from prism_serve.optimize.pipeline.instances import rankings
from prism_serve.optimize.pipeline.search import optimize
from prism_serve.optimize.pipeline.stages import verify_design
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.verify.check import check_numerics, small_program
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.optimize.workloads.oracles import default_assignment, load, node, oracle
from prism_serve.optimize.workloads.programs import moe_experts

from ..checkpoints import WARMUP_WORK
from .kernel_check import check_instance

H100 = get_gpu("h100")
E, K, H, I = 4, 2, 64, 32  # vLLM's CPU kernel takes hidden and intermediate sizes in multiples of 32


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids where expert 0 is every token's first choice and expert E - 1 nobody's, and
    softmax-normalised weights."""
    gen = torch.Generator().manual_seed(seed)
    second = torch.randint(1, E - 1, (tokens, 1), generator=gen)
    ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.int64), second], 1).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    return ids, weights


def _output(prog, inputs) -> torch.Tensor:
    out = evaluate(prog, inputs)
    return out["out"] if isinstance(out, dict) else out[0]


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_program_computes_what_vllms_cpu_fused_moe_computes(dtype, tolerance, tokens):
    vops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        pytest.skip("this vLLM build has no CPU fused MoE")
    prog = moe_experts(E, K, H, I, dtype)
    x, _, _, w13, w2 = random_inputs(prog, tokens, seed=tokens)
    ids, weights = _routing(tokens, tokens)
    ref = _output(prog, [x, ids, weights.to(x.dtype).reshape(tokens, K, 1, 1, 1), w13, w2]).reshape(tokens, H)
    out = torch.empty(tokens, H, dtype=x.dtype)
    stacked13, stacked2 = w13.reshape(E, 2 * I, H), w2.reshape(E, H, I)  # vLLM's layout, the same memory
    vops.cpu_fused_moe(out, x.reshape(tokens, H).contiguous(), vops.cpu_prepack_moe_weight(stacked13, "vec"),
                       vops.cpu_prepack_moe_weight(stacked2, "vec"), None, None, weights.to(x.dtype).float(), ids,
                       "silu", "vec")
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < tolerance, err


def test_the_gelu_tanh_form_and_bad_dims():
    prog = moe_experts(E, K, 16, 12, "float32", "gelu_tanh")
    assert prog.name == "moe_experts_gelu_tanh"
    x, ids, weights, w13, w2 = random_inputs(prog, 3, seed=0)
    want = torch.zeros(3, 16)
    for t in range(3):
        for j in range(K):
            e = ids[t, j]
            gate, up = x[t, 0, 0, 0] @ w13[e, 0].T, x[t, 0, 0, 0] @ w13[e, 1].T
            want[t] += weights[t, j, 0, 0, 0] * ((torch.nn.functional.gelu(gate, approximate="tanh") * up) @ w2[e, 0].T)
    assert torch.allclose(_output(prog, [x, ids, weights, w13, w2]).reshape(3, 16), want, atol=1e-5)
    with pytest.raises(ProgramError, match="top_k"):
        moe_experts(4, 5)
    with pytest.raises(ProgramError, match="activation"):
        moe_experts(activation="relu")


def _small(activation: str = "silu"):
    return moe_experts(E, K, 16, 12, "float32", activation)


def _decode_design(prog):
    gen = KernelGenerator(make_context(prog), max_kernels=1, max_block_ops=8, max_grid=3)
    return next(gen.explore(1, ((NUM_TOKENS,), "topk_ids1"), gen.choices(), 100_000))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_search_reaches_the_decode_design_and_both_checks_accept_it(activation):
    """Its first design over a token grid loops over the top-k choices: each step gathers the
    chosen expert's gate and up rows (windows of w13) and its w2 rows, runs the gated MLP, weights
    it and accumulates; each choice is a matmul batch dim of one."""
    prog = _small(activation)
    design = _decode_design(prog)
    (kernel,) = design.kernels
    assert kernel.loop == "topk_ids1" and [o.op for o in kernel.ops].count("gather") == 3
    assert [o.op for o in kernel.ops].count("accum") == 1
    proof, verdict, _ = verify_design(prog, design, H100)
    assert proof.ok, proof.reason
    assert verdict.ok, verdict.reasons


CHOICE = "topk_ids1"  # the label of each token's top-k choices
INTER = "w132"  # the label of the experts' intermediate dim
OUT_HIDDEN = "w22"  # the label of the output's hidden dim


def test_a_feeding_kernel_may_split_the_choices_and_the_search_reaches_the_two_kernel_design():
    """The top-k choices are a grid axis of a kernel that feeds another (one row per (token,
    choice)), never of the last (whose output has no choice dim), which tries loops over them first;
    of the feeding grids, those that split the output's hidden dim come last. At tiny Qwen2-MoE's
    dims, where the one-kernel decode design is over the register budget, the full search reaches
    within the tests' warmup work, and verifies, the two-kernel design with the activation in the
    first kernel's epilogue: per (token, choice) a loop over hidden gathers the chosen expert's gate
    and up rows and stores act(gate) * up alone (a feeding kernel's graphs that store fewer tensors
    come first), then per token (and hidden block) a loop over the choices gathers the w2 rows and
    sums the weighted products."""
    prog = moe_experts(E, K, 128, 96, "float32")
    gen = KernelGenerator(make_context(prog), max_kernels=2, max_block_ops=8, max_grid=4)
    choices = gen.choices()
    feeding = [c for c in choices if CHOICE in c[0]]
    last = gen.groups(choices, True)[1:]
    assert feeding and all(CHOICE not in c[0] for c in last)
    assert [c[1] for c in last[:2]] == [CHOICE, CHOICE] and all(c[1] != CHOICE for c in last[2:])
    assert gen.groups(choices, False)[:len(feeding)] == sorted(
        feeding, key=lambda c: (OUT_HIDDEN in c[0], len(c[0]), c[1] is not None))
    result = optimize(prog, H100, [8, 128], work=WARMUP_WORK, top=1, workers=1)
    assert result.found, result.stats.limit()
    up, down = result.found[0].design.kernels
    assert (up.grid, up.loop, down.loop) == ((NUM_TOKENS, CHOICE), "x4", CHOICE)
    assert [o.op for o in up.ops].count("gather") == 2 and [o.op for o in down.ops].count("gather") == 1
    assert [o.op for o in up.ops].count("store") == 1 and "silu" in [o.op for o in up.ops]
    assert "silu" not in [o.op for o in down.ops]


def test_a_feeding_kernel_may_split_the_intermediate_dim_beside_the_choices():
    """A feeding kernel's grid may split the intermediate dim, which only the gathered expert tables
    hold, beside the choices (never alone, never in the last kernel): a block per (token, choice,
    intermediate block) loops over hidden, as vLLM's w13 kernel does. The walk of that group reaches
    the two-kernel design, which verifies; at Qwen3-30B-A3B's dims and one token its 8 choices are 8
    blocks without the split, and with it the design models faster than vLLM's fused MoE priced by the
    same model, where the unsplit (token, choice) grid models far slower."""
    prog = moe_experts(E, K, 128, 96, "float32")
    gen = KernelGenerator(make_context(prog), max_kernels=2, max_block_ops=8, max_grid=3)
    choices = gen.choices()
    split = [c for c in choices if INTER in c[0]]
    assert split and all(CHOICE in c[0] for c in split)
    assert not any(INTER in c[0] for c in gen.groups(choices, True)[1:])
    first = ((NUM_TOKENS, CHOICE, INTER), "x4")
    design = next(gen.explore(2, first, choices, 60_000))
    up, down = design.kernels
    assert (up.grid, up.loop, down.loop) == (first[0], "x4", CHOICE)
    proof, verdict, _ = verify_design(prog, design, H100)
    assert proof.ok, proof.reason
    assert verdict.ok, verdict.reasons
    qwen3 = moe_experts(128, 8, 2048, 768, "bfloat16")
    unsplit = Design((BlockSpec((NUM_TOKENS, CHOICE), up.loop, up.ops, up.split), down))
    split_us, unsplit_us = (rankings(build(qwen3, d), H100, (1,))[0][0].modeled_us for d in (design, unsplit))
    assert split_us < vllm_modeled_us(qwen3, 1, H100) < unsplit_us


def test_the_numeric_check_runs_at_two_choices():
    """The small Program of the numeric check cuts the top-k choices to 2 (each a block of its own in
    the designs that split them), its other dims to 48, and keeps w13's gate and up halves."""
    small = {n.name: n.attr("shape") for n in small_program(moe_experts(128, 8, 2048, 768, "bfloat16")).inputs}
    assert small["topk_ids"] == (NUM_TOKENS, 2) and small["topk_weights"] == (NUM_TOKENS, 2, 1, 1, 1)
    assert small["w13"] == (48, 2, 48, 48) and small["w2"] == (48, 1, 48, 48)


def _edit(g: SGraph, edit) -> SGraph:
    k = g.kernels[0]
    return SGraph(g.name + "_mutant", g.program, g.intermediates,
                  (BlockKernel(k.name, k.grid, k.forloop, tuple(edit(n) for n in k.nodes)),))


def _swap_halves(n: Node) -> Node:
    """The gate's window of w13 read where the up rows are, and back."""
    if n.op == "slice" and n.inputs == ("ld_w13",):
        a = dict(n.attrs)
        start = 1 - a["start"]
        return Node(n.name, n.op, n.inputs, tuple(sorted((a | {"start": start, "stop": start + 1}).items())))
    return n


def _unweighted(n: Node) -> Node:
    """Each choice's output times itself, not its routing weight."""
    if n.op == "mul" and "ld_topk_weights" in n.inputs:
        other = next(s for s in n.inputs if s != "ld_topk_weights")
        return Node(n.name, n.op, (other, other), n.attrs)
    return n


def _max_of_choices(n: Node) -> Node:
    """The choices' outputs combined by a max, not a sum."""
    return Node(n.name, n.op, n.inputs, (("kind", "max"),)) if n.op == "accum" else n


def _first_experts(tensor: str):
    """Every choice routed to expert 0's rows of `tensor`, not to the chosen expert's: its gather by
    the top-k ids replaced by the first window of its experts dim."""
    def edit(n: Node) -> Node:
        if n.op == "gather" and n.inputs[0] == tensor:
            return Node(n.name, "slice", (tensor,), (("dim", 0), ("start", 0), ("step", 1), ("stop", 1)))
        return n
    return edit


DECODE_MUTANTS = {"halves_swapped": _swap_halves, "unweighted": _unweighted, "max_of_choices": _max_of_choices,
                  "down_of_expert_0": _first_experts("ld_w2")}


@pytest.mark.parametrize("mutant", sorted(DECODE_MUTANTS))
def test_a_wrong_moe_design_is_rejected_by_the_proof_and_the_numeric_check(mutant):
    prog = _small()
    g = build(prog, _decode_design(prog))
    bad = _edit(g, DECODE_MUTANTS[mutant])
    assert not prove_equivalent(bad).ok, "the proof accepted a wrong MoE design"
    inst = instantiate(bad, default_assignment(bad, target_tile=16) | {"BT0": 1, "F0": K}, H100)
    assert not check_numerics(inst, tokens=(1, 5), seed=0).ok, "the numeric check accepted a wrong MoE design"


def _edit_kernel(g: SGraph, index: int, edit) -> SGraph:
    kernels = list(g.kernels)
    k = kernels[index]
    kernels[index] = BlockKernel(k.name, k.grid, k.forloop, tuple(edit(n) for n in k.nodes))
    return SGraph(g.name + "_mutant", g.program, g.intermediates, tuple(kernels))


def _act_on_up(n: Node) -> Node:
    """The activation applied to the up product, the gate left linear."""
    if n.name == "a":
        return Node(n.name, n.op, ("upv",), n.attrs)
    if n.name == "hv":
        return Node(n.name, n.op, ("a", "gate"), n.attrs)
    return n


# the served two-kernel design's mutants: which kernel each edits, and how
TWO_KERNEL_MUTANTS = {"halves_swapped": (0, lambda n: _with_start(n, 1 - n.attr("start")) if n.op == "slice" else n),
                      "act_on_up": (0, _act_on_up),
                      "unweighted": (1, lambda n: Node(n.name, n.op, ("y", "y"), n.attrs) if n.name == "yw" else n),
                      "down_of_expert_0": (1, _first_experts("w2"))}


def _with_start(n: Node, start: int) -> Node:
    return Node(n.name, n.op, n.inputs, tuple(sorted((dict(n.attrs) | {"start": start, "stop": start + 1}).items())))


@pytest.mark.parametrize("mutant", sorted(TWO_KERNEL_MUTANTS))
def test_a_wrong_two_kernel_design_is_rejected_by_the_proof_and_the_numeric_check(mutant):
    index, edit = TWO_KERNEL_MUTANTS[mutant]
    good = oracle(_small())
    bad = _edit_kernel(good, index, edit)
    assert not prove_equivalent(bad).ok, "the proof accepted a wrong MoE design"
    inst = instantiate(bad, default_assignment(bad, block_tokens=1, target_tile=4), H100)
    assert not check_numerics(inst, tokens=(1, 5), seed=0).ok, "the numeric check accepted a wrong MoE design"


def test_the_routing_weight_applied_to_the_input_is_rejected_by_the_proof_and_the_numeric_check():
    """vLLM's `apply_router_weight_on_input` scales each token by its routing weight before the
    experts (which the plugin's hook leaves to vLLM): through the activation that is another
    function. The served design with x weighted in its first kernel and the weighted sum of its
    second taken unweighted is rejected by both checks."""
    good = oracle(_small())
    up, down = good.kernels

    def weighted_input(n: Node) -> list[Node]:
        if n.name == "x":
            return [n, load("wx", "topk_weights", (0, 1, None)), node("xw", "mul", "x", "wx")]
        return [Node(n.name, n.op, ("xw",) + n.inputs[1:], n.attrs) if n.op == "matmul" else n]

    def unweighted_output(n: Node) -> list[Node]:
        if n.name in ("wk", "yw"):
            return []
        return [Node(n.name, n.op, ("y",), n.attrs) if n.inputs == ("yw",) else n]

    bad = SGraph(good.name + "_mutant", good.program, good.intermediates,
                 (BlockKernel(up.name, up.grid, up.forloop, tuple(m for n in up.nodes for m in weighted_input(n))),
                  BlockKernel(down.name, down.grid, down.forloop,
                              tuple(m for n in down.nodes for m in unweighted_output(n)))))
    assert not prove_equivalent(bad).ok, "the proof accepted the routing weight applied to the input"
    inst = instantiate(bad, default_assignment(bad, block_tokens=1, target_tile=4), H100)
    assert not check_numerics(inst, tokens=(1, 5), seed=0).ok, "the numeric check accepted it"
    with pytest.raises(AssertionError, match="over tolerance"):  # and at ordinary inputs, not only at outliers
        check_instance(inst, 3, "float32")


def test_a_top_k_that_is_no_power_of_two_gets_tiles_of_one_choice():
    """Grid and loop symbols take powers of two that divide their dim, and for a dim of an integer
    input also its size: each choice is a tile of its own, as a block matmul's batch dim must be.
    Three choices (DeepSeek's are 6) then have an instance, which computes the Program at 1 and 7
    tokens; at DeepSeek-V2-Lite's experts (64, top 6, hidden 2048, intermediate 1408) the served
    design models faster at one token than vLLM's fused MoE priced by the same model."""
    prog = moe_experts(5, 3, 32, 24, "float32")
    g = oracle(prog)
    choices = symbol_choices(g)
    assert choices["K"] == (1, 3) and choices["FK"] == (1, 3)
    assert choices["GI"] == (1, 2, 4, 8)  # the intermediate dim's: no index input holds it
    for tokens in (1, 7):
        inst = rankings(g, H100, (tokens,))[0][0].instance
        assert dict(inst.assignment)["K"] == 3 and dict(inst.assignment)["FK"] == 3
        check_instance(inst, tokens, "float32")
    deepseek = moe_experts(64, 6, 2048, 1408, "bfloat16")
    assert rankings(oracle(deepseek), H100, (1,))[0][0].modeled_us < vllm_modeled_us(deepseek, 1, H100)


def test_a_design_that_routes_a_token_to_the_next_expert_cannot_be_built():
    """A kernel reading expert e + 1's rows for choice e (the w2 table gathered from its second row
    on) is no sGraph: the check refuses a gather along a dim a slice narrowed, so such a design
    never reaches the proof, the numeric check or the registry."""
    good = oracle(_small())
    up, down = good.kernels

    def next_expert(n: Node) -> list[Node]:
        if n.op == "gather" and n.inputs[0] == "w2":
            return [node("w2_next", "slice", "w2", dim=0, start=1, stop=E, step=1),
                    Node(n.name, n.op, ("w2_next",) + n.inputs[1:], n.attrs)]
        return [n]

    nodes = tuple(m for n in down.nodes for m in next_expert(n))
    with pytest.raises(SGraphError, match="which a slice narrowed"):
        SGraph(good.name + "_mutant", good.program, good.intermediates,
               (up, BlockKernel(down.name, down.grid, down.forloop, nodes)))
