"""Region finding on hand-built FX graphs, without vLLM: chaining, dims, and the never-crash paths."""

from __future__ import annotations

import torch
import torch.fx as fx

from prism_serve.capture import backend
from prism_serve.capture.regions import find_regions, module_groups


def rms_norm(x, w, eps, _):  # stands in for vllm_ir.rms_norm; matched by name
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def linear(x, w):
    return x @ w.t()


class RMSNorm:  # classes named like vLLM's, for nn_module_stack
    pass


class QKVParallelLinear:
    pass


def _graph(norm_target=rms_norm, n=5, hidden=16, out=48):
    g = fx.Graph()
    x, w, wl = g.placeholder("x"), g.placeholder("w"), g.placeholder("wl")
    x.meta["example_value"] = torch.randn(n, hidden)

    def call(fn, args, path, cls, val):
        node = g.call_function(fn, args)
        node.meta["nn_module_stack"] = {path: (f"L['self'].{path}", cls)}
        node.meta["example_value"] = val
        return node

    h = call(norm_target, (x, w, 1e-5, None) if norm_target is rms_norm else (x, w),
             "layers.3.input_layernorm", RMSNorm, torch.randn(n, hidden))
    y = call(linear, (h, wl), "layers.3.self_attn.qkv_proj", QKVParallelLinear, torch.randn(n, out))
    g.output(y)
    return g


def test_norm_feeding_a_projection_is_rmsnorm_linear():
    regions, groups = find_regions(_graph())
    assert set(groups) == {"layers.3.input_layernorm", "layers.3.self_attn.qkv_proj"}
    kinds = {r["kind"]: r for r in regions}
    assert set(kinds) == {"rms_norm", "rmsnorm_linear"}
    rl = kinds["rmsnorm_linear"]
    assert rl["layer"] == 3 and rl["dims"] == {"hidden": 16, "out": 48} and rl["eps"] == 1e-5
    assert rl["inputs"][2] == {"param": "layers.3.self_attn.qkv_proj"}


def fused_add_rms_norm(x, residual, w, eps, _):  # stands in for vllm_ir.fused_add_rms_norm
    r = x + residual
    return rms_norm(r, w, eps, None), r


def test_a_norm_that_adds_the_residual_feeding_a_projection_is_fused_add_rmsnorm_linear():
    import operator

    n, hidden, out = 3, 16, 40
    g = fx.Graph()
    x, res, w, wl = (g.placeholder(name) for name in ("x", "res", "w", "wl"))
    x.meta["example_value"] = res.meta["example_value"] = torch.randn(n, hidden)
    stack = {"nn_module_stack": {"layers.2.input_layernorm": ("L['self'].layers.2.input_layernorm", RMSNorm)}}
    op = g.call_function(fused_add_rms_norm, (x, res, w, 1e-5, None))
    y, s = (g.call_function(operator.getitem, (op, i)) for i in (0, 1))
    for node in (op, y, s):
        node.meta.update(stack, example_value=torch.randn(n, hidden))
    lin = g.call_function(linear, (y, wl))
    lin.meta.update(nn_module_stack={"layers.2.self_attn.qkv_proj": ("L['self'].layers.2.self_attn.qkv_proj",
                                                                      QKVParallelLinear)},
                    example_value=torch.randn(n, out))
    g.output((lin, s))
    kinds = {r["kind"]: r for r in find_regions(g)[0]}
    assert set(kinds) == {"fused_add_rms_norm", "fused_add_rmsnorm_linear"}
    fl = kinds["fused_add_rmsnorm_linear"]
    assert fl["dims"] == {"hidden": hidden, "out": out} and fl["layer"] == 2
    # the Program's inputs (x, residual, g, W) and outputs (y, the residual sum)
    assert [ref.get("node", ref.get("param")) for ref in fl["inputs"]] == ["x", "res", "w",
                                                                             "layers.2.self_attn.qkv_proj"]
    assert [ref["node"] for ref in fl["outputs"]] == [lin.name, s.name]


def test_a_norm_that_is_not_a_vllm_ir_op_is_reported_unsupported():
    regions, _ = find_regions(_graph(norm_target=torch.mul))
    assert [(r["kind"], r["supported"]) for r in regions] == [("rms_norm", False)]
    assert "not traced" in regions[0]["reason"]


def test_group_data_flow():
    groups = module_groups(_graph())
    norm, lin = groups["layers.3.input_layernorm"], groups["layers.3.self_attn.qkv_proj"]
    assert lin.ext_inputs == norm.ext_outputs


def test_backend_never_raises_on_a_graph_it_cannot_analyse(monkeypatch):
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())

    def broken(graph):
        raise RuntimeError("boom")

    monkeypatch.setattr(backend, "find_regions", broken)
    gm = fx.GraphModule(torch.nn.Module(), _graph())
    run = backend.capture_backend(gm, [])
    x, w, wl = torch.randn(5, 16), torch.ones(16), torch.randn(48, 16)
    torch.testing.assert_close(run(x, w, wl), linear(rms_norm(x, w, 1e-5, None), wl))
    assert backend.STATE.regions[0]["kind"] == "analysis_error" and "boom" in backend.STATE.regions[0]["reason"]


def test_instrumented_graph_computes_the_same(monkeypatch):
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    gm = fx.GraphModule(torch.nn.Module(), _graph())
    run = backend.capture_backend(gm, [])
    x, w, wl = torch.randn(5, 16), torch.ones(16), torch.randn(48, 16)
    with torch.profiler.profile() as prof:
        got = run(x, w, wl)
    torch.testing.assert_close(got, gm(x, w, wl))
    keys = {e.key for e in prof.key_averages()}
    assert {backend.FORWARD_RANGE, backend.RANGE_PREFIX + "layers.3.input_layernorm"} <= keys


def test_recorder_takes_region_inputs_and_outputs_in_builder_order(monkeypatch):
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    gm = fx.GraphModule(torch.nn.Module(), _graph())
    run = backend.capture_backend(gm, [])
    x, w, wl = torch.randn(5, 16), torch.rand(16), torch.randn(48, 16)
    backend.STATE.record_pending = 1
    run(x, w, wl)
    run(x, w, wl)  # not recorded
    assert backend.STATE.record_pending == 0 and len(backend.STATE.recorded) == 1
    recorded = backend.STATE.recorded[0][1]
    kinds = [r["kind"] for r in backend.STATE.regions]
    norm = recorded[kinds.index("rms_norm")]
    torch.testing.assert_close(norm["inputs"], [x, w])
    torch.testing.assert_close(norm["outputs"], [rms_norm(x, w, 1e-5, None)])
    rl = recorded[kinds.index("rmsnorm_linear")]
    torch.testing.assert_close(rl["inputs"][:2], [x, w])  # the weight comes from the module, not the graph
    torch.testing.assert_close(rl["outputs"], [linear(rms_norm(x, w, 1e-5, None), wl)])


class RotaryEmbedding:
    pass


class Attention:
    pass


def rotary_embedding(positions, q, k, head_size, cache, is_neox):  # stands in for _C.rotary_embedding
    q.mul_(2.0)
    k.mul_(3.0)


def unified_attention_with_output(q, k, v, out, layer):  # stands in for vllm.unified_attention_with_output
    out.copy_(q)


def _attention_graph(rotary_target=rotary_embedding, n=3, heads=4, kv=2, hd=8):
    g = fx.Graph()
    pos, q, k, v, cache = (g.placeholder(s) for s in ("positions", "q", "k", "v", "cache"))
    for p, val in ((pos, torch.arange(n)), (q, torch.randn(n, heads * hd)), (k, torch.randn(n, kv * hd)),
                   (v, torch.randn(n, kv * hd)), (cache, torch.randn(64, hd))):
        p.meta["example_value"] = val

    def call(fn, args, path, cls, val=None):
        node = g.call_function(fn, args)
        node.meta["nn_module_stack"] = {path: (f"L['self'].{path}", cls)}
        node.meta["example_value"] = val
        return node

    rot_args = (pos, q, k, hd, cache, True) if rotary_target is rotary_embedding else (q,)
    call(rotary_target, rot_args, "layers.1.self_attn.rotary_emb", RotaryEmbedding)
    path = "layers.1.self_attn.attn"
    qv = call(torch.reshape, (q, (n, heads, hd)), path, Attention, torch.randn(n, heads, hd))
    kv_ = call(torch.reshape, (k, (n, kv, hd)), path, Attention, torch.randn(n, kv, hd))
    vv = call(torch.reshape, (v, (n, kv, hd)), path, Attention, torch.randn(n, kv, hd))
    out = call(torch.empty_like, (qv,), path, Attention, torch.randn(n, heads, hd))
    call(unified_attention_with_output, (qv, kv_, vv, out, "layer"), path, Attention)
    g.output(call(torch.clone, (out,), path, Attention, torch.randn(n, heads, hd)))
    return g


def test_rotary_and_attention_are_reported_with_dims_and_a_reason():
    regions, _ = find_regions(_attention_graph())
    by_kind = {r["kind"]: r for r in regions}
    rot, attn = by_kind["rotary_embedding"], by_kind["attention"]
    assert rot["dims"] == {"heads": 4, "kv_heads": 2, "head_dim": 8, "rotary_dim": 8, "max_position": 64,
                           "neox": 1}
    assert attn["dims"] == {"heads": 4, "kv_heads": 2, "head_dim": 8}
    assert not rot["supported"] and not attn["supported"] and rot["layer"] == attn["layer"] == 1
    assert "gather" in rot["reason"] and "kv_len" in attn["reason"]


def test_a_rotary_that_is_not_the_vllm_op_is_unsupported_without_dims():
    regions, _ = find_regions(_attention_graph(rotary_target=torch.neg))
    rot = next(r for r in regions if r["kind"] == "rotary_embedding")
    assert rot["dims"] == {} and not rot["supported"] and "not traced" in rot["reason"]


def test_recorder_takes_in_place_rotary_outputs_after_the_op(monkeypatch):
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    gm = fx.GraphModule(torch.nn.Module(), _attention_graph())
    run = backend.capture_backend(gm, [])
    pos, cache = torch.arange(3), torch.randn(64, 8)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    q0, k0 = q.clone(), k.clone()
    backend.STATE.record_pending = 1
    run(pos, q, k, v, cache)
    recorded = backend.STATE.recorded[0][1]
    kinds = [r["kind"] for r in backend.STATE.regions]
    rot = recorded[kinds.index("rotary_embedding")]
    torch.testing.assert_close(rot["inputs"], [pos, q0, k0, cache])  # taken before the in-place op
    torch.testing.assert_close(rot["outputs"], [2 * q0, 3 * k0])  # and after it
    attn = recorded[kinds.index("attention")]
    torch.testing.assert_close(attn["outputs"], [(2 * q0).reshape(3, 4, 8)])


def test_a_rotary_op_without_traced_shapes_is_unsupported_not_a_crash():
    g = _attention_graph()
    next(n for n in g.nodes if n.name == "cache").meta.pop("example_value")
    regions, _ = find_regions(g)
    rot = next(r for r in regions if r["kind"] == "rotary_embedding")
    assert rot["dims"] == {} and not rot["supported"] and "without tensor shapes" in rot["reason"]
    assert next(r for r in regions if r["kind"] == "attention")["dims"]  # the rest is still found
