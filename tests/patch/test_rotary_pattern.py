"""The fusion pass's rotary matcher (`rotary_match`) and replacement (`fusion.serve_rotary`) on
hand-written FX graphs in the forms vLLM's compiled graph holds (Inductor's post-grad aten form of
`RotaryEmbedding.forward_static`, NeoX and GPT-J, full and partial rotary_dim, with and without the
QK-norm before it; the custom op `_C.rotary_embedding` functionalized), with near misses that must
stay vLLM's; and the `prism::` ops' dispatch: a kernel's inputs in its Program's order and shapes,
vLLM's semantics on a miss."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from prism_serve.optimize.ir.reference import as_torch_function
from prism_serve.patch import fusion, ops, rotary_match
from prism_serve.patch.table import Launcher, Table, disjoint
from prism_serve.region_table import KINDS

aten = torch.ops.aten
T, HQ, HK, D, MAXPOS, EPS = 5, 4, 2, 32, 64, 1e-6


def _rotate(x, cos, sin, rotary_dim: int, neox: bool, off: int = 0):
    """One side as Inductor's post-grad graph holds vLLM's forward_static (no empty pass-through cat)."""
    rot = x if rotary_dim == D else aten.slice.Tensor(x, 2, 0, rotary_dim)
    cos, sin = aten.unsqueeze.default(cos, -2), aten.unsqueeze.default(sin, -2)
    if off:  # a near miss: the second "half" starts elsewhere
        x1, x2 = aten.slice.Tensor(rot, 2, 0, rotary_dim // 2), aten.slice.Tensor(rot, 2, off, off + rotary_dim // 2)
    elif neox:
        x1, x2 = aten.split.Tensor(rot, rotary_dim // 2, -1)
    else:
        x1, x2 = aten.slice.Tensor(rot, 2, 0, 2 ** 63 - 1, 2), aten.slice.Tensor(rot, 2, 1, 2 ** 63 - 1, 2)
    o1 = aten.sub.Tensor(aten.mul.Tensor(x1, cos), aten.mul.Tensor(x2, sin))
    o2 = aten.add.Tensor(aten.mul.Tensor(x2, cos), aten.mul.Tensor(x1, sin))
    if neox:
        out = aten.cat.default([o1, o2], -1)
    else:
        pairs = aten.cat.default([aten.unsqueeze.default(o1, -1), aten.unsqueeze.default(o2, -1)], -1)
        out = aten.reshape.default(pairs, [T, x.shape[1], rotary_dim])
    if rotary_dim == D:
        return out
    return aten.cat.default([out, aten.slice.Tensor(x, 2, rotary_dim, 2 ** 63 - 1)], -1)


def _norm(x, w, eps):
    """vLLM's RMSNorm native body (fp32) on a head view, as the post-grad graph holds it."""
    r = aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True), eps))
    return aten.mul.Tensor(aten.mul.Tensor(x, r), w)


def _graph(rotary_dim=D, neox=True, qk_norm=False, k_cache=False, half=None, swap=False, k_eps=EPS):
    """vLLM's qkv split -> [QK-norm] -> rotary -> attention's q, k, as a traced aten graph. Near misses:
    `k_cache` rotates k by another cache (another rotary base), `half` takes the head's second "half"
    from that offset (a slice that is not half the head), `swap` swaps cos and sin, `k_eps` norms k
    with another epsilon."""
    def fn(positions, qkv, cache, cache2, qw, kw):
        q, k, _ = aten.split_with_sizes.default(qkv, [HQ * D, HK * D, HK * D], -1)
        q, k = aten.reshape.default(q, [T, HQ, D]), aten.reshape.default(k, [T, HK, D])
        if qk_norm:
            q, k = _norm(q, qw, EPS), _norm(k, kw, k_eps)
        outs, gathered = [], {}
        for x, table in ((q, cache), (k, cache2 if k_cache else cache)):
            if table not in gathered:  # one gather of each cache, as vLLM's forward_static does for q and k
                gathered[table] = aten.split.Tensor(aten.index.Tensor(table, [positions]), rotary_dim // 2, -1)
            cos, sin = gathered[table]
            outs.append(_rotate(x, sin if swap else cos, cos if swap else sin, rotary_dim, neox, half or 0))
        return outs[0] * 1.0, outs[1] * 1.0  # the attention's readers
    args = _inputs(rotary_dim)
    return make_fx(fn, tracing_mode="fake")(*args).graph, args


def _inputs(rotary_dim):
    gen = torch.Generator().manual_seed(0)
    return (torch.tensor([0, 3, MAXPOS - 1, 3, 7]), torch.randn(T, (HQ + 2 * HK) * D, generator=gen),
            torch.randn(MAXPOS, rotary_dim, generator=gen), torch.randn(MAXPOS, rotary_dim, generator=gen),
            1 + 0.1 * torch.randn(D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen))


def _key(rotary_dim, neox, eps=None):
    return torch.float32, (HQ, HK, D, rotary_dim, MAXPOS, int(neox)), eps


FORMS = [(D, True), (D // 2, True), (D, False), (D // 2, False)]  # full / partial, NeoX / GPT-J


@pytest.mark.parametrize("rotary_dim,neox", FORMS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_each_native_form_is_one_region_with_its_key(rotary_dim, neox, qk_norm):
    graph, _ = _graph(rotary_dim, neox, qk_norm)
    (r,) = rotary_match.find_rotary(graph)
    assert r.kind is KINDS["qk_norm_rotary" if qk_norm else "rotary"]
    assert r.key == _key(rotary_dim, neox, EPS if qk_norm else None) and r.neox == neox and r.head_size == D
    assert r.positions.name == "positions_1" and r.cache.name == "cache_1"


@pytest.mark.parametrize("near_miss", [{"k_cache": True}, {"half": 12}, {"swap": True}])
def test_near_misses_stay_vllms(near_miss):
    """Another rotary base for k (its own cache), a split that is not half the rotated width, cos and
    sin swapped: no region."""
    graph, _ = _graph(**near_miss)
    assert rotary_match.find_rotary(graph) == []


def test_norms_of_two_epsilons_leave_the_rotation_alone():
    graph, _ = _graph(qk_norm=True, k_eps=1e-5)
    (r,) = rotary_match.find_rotary(graph)
    assert r.kind is KINDS["rotary"] and r.norms is None and r.key == _key(D, True)


def _reference_launcher(kind: str, key) -> Launcher:
    """A 'kernel' that is the Program's torch reference: the dispatch's inputs in the Program's order."""
    dtype, dims, eps = key
    names = KINDS[kind].key_names
    prog = KINDS[kind].program(dict(zip(names, dims)), "float32", eps)
    return Launcher(as_torch_function(prog), 1, 1, 8192)


@pytest.fixture
def served():
    """A runtime whose table serves every key the tests use, by the Programs' torch references."""
    keys = {"rotary": [_key(r, n) for r, n in FORMS], "qk_norm_rotary": [_key(r, n, EPS) for r, n in FORMS]}
    table = Table("cpu", {kind: {k: disjoint([_reference_launcher(kind, k)]) for k in ks} for kind, ks in keys.items()})
    rt = ops.open_runtime(table)
    yield rt
    rt.close()


@pytest.mark.parametrize("rotary_dim,neox", FORMS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_pass_replaces_the_region_by_one_prism_op_with_vllms_result(served, rotary_dim, neox, qk_norm):
    graph, args = _graph(rotary_dim, neox, qk_norm)
    want = torch.fx.GraphModule(torch.nn.Module(), graph)(*args)
    done = fusion.serve_rotary(graph, served.table)
    kind = "qk_norm_rotary" if qk_norm else "rotary"
    assert done == {kind: 1}
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(getattr(torch.ops.prism, kind).default) == 1
    # the chain is gone, the QK-norm's too
    assert not {aten.cat.default, aten.index.Tensor, aten.rsqrt.default} & set(targets)
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(*args)
    assert served.counts[kind] == 1 and served.misses[kind] == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_qk_norm_rotary_without_its_kernel_serves_the_rotation_and_keeps_the_norms(served):
    graph, args = _graph(qk_norm=True, k_eps=EPS)
    served.table.ops.pop("qk_norm_rotary")
    want = torch.fx.GraphModule(torch.nn.Module(), graph)(*args)
    assert fusion.serve_rotary(graph, served.table) == {"rotary": 1}
    assert sum(n.target is aten.rsqrt.default for n in graph.nodes) == 2  # q's and k's norms stay vLLM's
    for g, w in zip(torch.fx.GraphModule(torch.nn.Module(), graph)(*args), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_no_kernel_for_the_key_leaves_the_graph_alone(served):
    graph, _ = _graph(D, True)
    served.table.ops["rotary"] = {k: v for k, v in served.table.ops["rotary"].items() if k != _key(D, True)}
    before = [n.target for n in graph.nodes]
    assert fusion.serve_rotary(graph, served.table) == {}
    assert [n.target for n in graph.nodes] == before


def test_the_custom_op_form_is_matched_where_custom_ops_are_on(served):
    """`auto_functionalized(_C.rotary_embedding, ...)` on q, k [tokens, heads * head_dim] views."""
    vllm_ops = pytest.importorskip("vllm._custom_ops")
    del vllm_ops

    def fn(positions, qkv, cache):
        q, k, _ = aten.split_with_sizes.default(qkv, [HQ * D, HK * D, HK * D], -1)
        out = torch.ops.higher_order.auto_functionalized(
            torch.ops._C.rotary_embedding.default, positions=positions, query=q.clone(), key=k.clone(), head_size=D,
            cos_sin_cache=cache, is_neox=True)
        return out[1] * 1.0, out[2] * 1.0
    args = _inputs(D)[:3]
    graph = make_fx(fn, tracing_mode="fake")(*args).graph
    (r,) = rotary_match.find_rotary(graph)
    assert r.kind is KINDS["rotary"] and r.key == _key(D, True)
    want = torch.fx.GraphModule(torch.nn.Module(), graph)(*args)
    assert fusion.serve_rotary(graph, served.table) == {"rotary": 1}
    for g, w in zip(torch.fx.GraphModule(torch.nn.Module(), graph)(*args), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim,neox", FORMS)
def test_dispatch_views_vllms_q_and_k_as_the_programs_and_a_miss_runs_vllms_semantics(served, rotary_dim, neox):
    positions, qkv, cache, _, qw, kw = _inputs(rotary_dim)
    q, k, _ = qkv.split([HQ * D, HK * D, HK * D], -1)  # strided views, as vLLM hands them over
    want = ops.ref_rotary(positions, q, k, cache, D, neox)
    got = torch.ops.prism.rotary(positions, q, k, cache, D, neox)
    assert served.counts["rotary"] == 1 and [g.shape for g in got] == [q.shape, k.shape]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    normed = [ops.ref_rms_norm(x.reshape(T, -1, D), w, EPS).reshape(x.shape) for x, w in ((q, qw), (k, kw))]
    got = torch.ops.prism.qk_norm_rotary(positions, q, k, qw, kw, cache, EPS, D, neox)
    assert served.counts["qk_norm_rotary"] == 1
    for g, w in zip(got, ops.ref_rotary(positions, *normed, cache, D, neox)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # a miss (another max_position: no kernel) runs vLLM's semantics, leaving q and k as they were
    q0, longer = q.clone(), torch.cat([cache, cache[:1]])
    got = torch.ops.prism.rotary(positions, q, k, longer, D, neox)
    assert served.misses["rotary"] == 1 and torch.equal(q, q0)
    for g, w in zip(got, ops.ref_rotary(positions, q, k, longer, D, neox)):
        torch.testing.assert_close(g, w)


def test_the_ops_fakes_keep_q_and_ks_shapes():
    positions, qkv, cache, _, qw, kw = _inputs(D)
    real = (positions, qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D], cache, qw, kw)
    with torch._subclasses.FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in real]
        q, k = torch.ops.prism.qk_norm_rotary(f[0], f[1], f[2], f[4], f[5], f[3], EPS, D, True)
    assert (q.shape, k.shape) == ((T, HQ * D), (T, HK * D))
