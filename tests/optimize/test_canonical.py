"""The canonical sGraph hash: invariant under renaming and reordering independent ops, sensitive
to every semantic change (properties checked with hypothesis over random renamings / orders)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.ir.program import Node, node
from prism_serve.optimize.ir.schema import sgraph_from_json
from prism_serve.optimize.ir.sgraph import BlockKernel, GridAxis, LibraryKernel, SGraph, TensorDecl, sym, to_expr
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS


def _library_mlp() -> SGraph:
    """rmsnorm_mlp as four library kernels: the two projections are independent."""
    prog = WORKLOADS["rmsnorm_mlp"].program(hidden=64)
    inter = tuple(TensorDecl(n, tuple(map(to_expr, prog.types[n].shape)), "float16") for n in ("xn", "u", "v"))
    kernels = tuple(LibraryKernel(prog.by_name[n]) for n in ("xn", "u", "v", "y"))
    return SGraph("mlp_library", prog, inter, kernels)


SGRAPHS = {
    "rmsnorm_linear": lambda: oracle(WORKLOADS["rmsnorm_linear"].program(hidden=128)),
    "attention": lambda: oracle(WORKLOADS["attention"].program(kv_len=64, head_dim=32)),
    "qk_norm_attention": lambda: oracle(WORKLOADS["qk_norm_attention"].program(kv_len=64, head_dim=32)),
    "fused_add_rmsnorm_linear": lambda: oracle(WORKLOADS["fused_add_rmsnorm_linear"].program(hidden=64)),
    "mlp_library": _library_mlp,
    "rotary": lambda: oracle(WORKLOADS["rotary"].program(num_q_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8,
                                                          max_position=32, style="gptj")),
    "qk_norm_rotary": lambda: oracle(WORKLOADS["qk_norm_rotary"].program(num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                                          max_position=32)),
}
BUILT = {name: build() for name, build in SGRAPHS.items()}


# --- renaming and reordering ----------------------------------------------------------------

def _topological_shuffle(items: list, deps, rng: random.Random) -> list:
    """A random topological order of `items`; deps(i, j) says item i must precede item j."""
    left, out = list(items), []
    while left:
        ready = [j for j in left if not any(deps(i, j) for i in left if i is not j)]
        pick = rng.choice(ready)
        out.append(pick)
        left.remove(pick)
    return out


def _rename_node(n: Node, names: dict[str, str], tensors: dict[str, str]) -> Node:
    attrs = {k: (tensors.get(v, v) if k == "tensor" else v) for k, v in n.attrs}
    return node(names[n.name], n.op, *(names[s] for s in n.inputs), **attrs)


def scramble(g: SGraph, seed: int) -> SGraph:
    """`g` with fresh names for every intermediate, kernel, block node and symbol, and kernels and
    block nodes in a random topological order."""
    rng = random.Random(seed)
    fresh = iter(f"t{rng.randrange(10**6)}_{i}" for i in range(10**6))
    tensors = {t.name: next(fresh) for t in g.intermediates}
    symbols = {s: f"S{next(fresh)}" for s in g.symbols}
    subs = {sym(s): sym(v) for s, v in symbols.items()}

    def written(k) -> set[str]:
        return {k.op.name} if isinstance(k, LibraryKernel) else {s.attr("tensor") for s in k.stores}

    def read(k) -> set[str]:
        return set(k.op.inputs) if isinstance(k, LibraryKernel) else {n.attr("tensor") for n in k.loads}

    order = _topological_shuffle(list(g.kernels), lambda a, b: bool(written(a) & (read(b) | written(b))), rng)
    kernels = []
    for k in order:
        if isinstance(k, LibraryKernel):
            n = k.op
            renamed = {s: tensors.get(s, s) for s in (*n.inputs, n.name)}
            kernels.append(LibraryKernel(_rename_node(n, renamed, tensors)))
            continue
        names = {n.name: next(fresh) for n in k.nodes}
        nodes = _topological_shuffle(list(k.nodes), lambda a, b: a.name in b.inputs, rng)
        grid = tuple(GridAxis(symbols[a.symbol], a.over_tokens) for a in k.grid)
        kernels.append(BlockKernel(next(fresh), grid, symbols[k.forloop] if k.forloop else None,
                                   tuple(_rename_node(n, names, tensors) for n in nodes)))
    inter = tuple(TensorDecl(tensors[t.name], tuple(sympy.sympify(d).xreplace(subs) for d in t.shape), t.dtype)
                  for t in rng.sample(list(g.intermediates), len(g.intermediates)))
    return SGraph(f"renamed_{seed}", g.program, inter, tuple(kernels))


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(SGRAPHS)), seed=st.integers(0, 2**32 - 1))
def test_renaming_and_reordering_keep_the_hash(name, seed):
    g = BUILT[name]
    other = scramble(g, seed)
    assert {k.name for k in other.kernels if isinstance(k, BlockKernel)}.isdisjoint(
        k.name for k in g.kernels if isinstance(k, BlockKernel))
    assert set(other.symbols).isdisjoint(g.symbols)
    assert canonical_hash(other) == canonical_hash(g)


def test_scramble_really_reorders_independent_kernels():
    """Guard for the property above: the library MLP's projections do get swapped."""
    orders = {tuple(k.op.op + ":" + k.op.inputs[1] for k in scramble(BUILT["mlp_library"], s).kernels
                    if k.op.op == "matmul") for s in range(20)}
    assert len(orders) == 2


# --- semantic mutations ---------------------------------------------------------------------

def _edit_block(g: SGraph, kernel: int, name: str, fn) -> SGraph:
    k = g.kernels[kernel]
    nodes = tuple(fn(n) if n.name == name else n for n in k.nodes)
    kernels = g.kernels[:kernel] + (replace(k, nodes=nodes),) + g.kernels[kernel + 1:]
    return SGraph(g.name, g.program, g.intermediates, kernels)


def _with_attr(n: Node, **attrs) -> Node:
    return node(n.name, n.op, *n.inputs, **(dict(n.attrs) | attrs))


def _mutants():
    lin, att = BUILT["rmsnorm_linear"], BUILT["attention"]
    k0 = att.kernels[0]
    yield "constant", _edit_block(lin, 0, "eps", lambda n: _with_attr(n, value=1e-5))
    yield "accumulator kind", _edit_block(lin, 0, "acc_ss", lambda n: _with_attr(n, kind="max"))
    yield "mean accumulator", _edit_block(lin, 0, "acc_ss", lambda n: _with_attr(n, kind="mean"))
    yield "operand order", _edit_block(att, 1, "dm", lambda n: node(n.name, "sub", "mx", "mp"))
    yield "op", _edit_block(att, 1, "w", lambda n: node(n.name, "silu", *n.inputs))
    yield "dim", oracle(WORKLOADS["rmsnorm_linear"].program(hidden=256))
    yield "dtype", oracle(WORKLOADS["rmsnorm_linear"].program(hidden=128, dtype="float32"))
    k = lin.kernels[0]
    flipped = tuple(_with_attr(n, **{m: tuple(reversed(n.attr(m)))}) if n.op in ("load", "store") else n
                    for n in k.nodes for m in ["imap" if n.op == "load" else "omap"])
    yield "grid axis order", SGraph(lin.name, lin.program, (), (replace(k, grid=k.grid[::-1], nodes=flipped),))
    # the combine kernel's head axis no longer the split kernel's: a larger symbol space
    yield "symbol sharing", SGraph(att.name, att.program, att.intermediates, (k0, replace(
        att.kernels[1], grid=(att.kernels[1].grid[0], GridAxis("H2")))))
    rot = BUILT["rotary"]  # GPT-J: q_x1 the even elements, q_x2 the odd ones
    yield "slice start", _edit_block(rot, 0, "q_x1", lambda n: _with_attr(n, start=1))
    yield "interleave", _edit_block(rot, 0, "q_rot", lambda n: _with_attr(n, interleave=False))
    yield "concat order", _edit_block(rot, 0, "k_rot", lambda n: node(n.name, "concat", *n.inputs[::-1], **dict(n.attrs)))
    yield "gathered half", _edit_block(rot, 0, "cos", lambda n: node(n.name, "gather", "sin_t", "pos", dim=0))


def test_semantic_mutations_change_the_hash():
    base = {canonical_hash(g) for g in BUILT.values()}
    seen = {}
    for what, g in _mutants():
        h = canonical_hash(g)
        assert h not in base, f"mutation '{what}' kept the hash"
        assert h not in seen, f"mutations '{what}' and '{seen.get(h)}' collide"
        seen[h] = what


def test_a_second_recomputing_kernel_changes_the_hash():
    """Recomputation is semantic: the same producer twice is a different design from once."""
    g = BUILT["mlp_library"]
    xn2 = TensorDecl("xn2", g.tensors["xn"].shape, "float16")
    rms = g.program.by_name["xn"]
    again = (LibraryKernel(node("xn2", "rms_norm", *rms.inputs, eps=rms.attr("eps"))),)
    v = LibraryKernel(node("v", "matmul", "xn2", "w_gate", transpose_b=True))
    kernels = (g.kernels[0], g.kernels[1]) + again + (v, g.kernels[3])
    other = SGraph("recompute", g.program, g.intermediates + (xn2,), kernels)
    assert canonical_hash(other) != canonical_hash(g)
    assert canonical_hash(scramble(other, 3)) == canonical_hash(other)


@pytest.mark.parametrize("name", sorted(SGRAPHS))
def test_hash_is_stable_text(name):
    h = canonical_hash(BUILT[name])
    assert len(h) == 32 and int(h, 16) >= 0
    assert canonical_hash(sgraph_from_json(BUILT[name].to_json())) == h
