"""Region finding on hand-built FX graphs, without vLLM: chaining, dims, and the never-crash paths."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from prism_serve.capture import backend
from prism_serve.capture.regions import find_regions, module_groups
from prism_serve.region_table import KINDS

from ..cpu_gemm import onednn_handles


vllm_ir = pytest.importorskip("vllm.ir")  # registers vLLM's IR ops, which the graphs call as Dynamo traces them
rms_norm = torch.ops.vllm_ir.rms_norm.default
linear = torch._C._nn.linear  # torch's linear, as Dynamo traces F.linear


class RMSNorm:  # classes named like vLLM's, for nn_module_stack
    pass


class QKVParallelLinear:
    pass


def _graph(norm_target=rms_norm, n=5, hidden=16, out=48, bias=False):
    g = fx.Graph()
    x, w, wl = g.placeholder("x"), g.placeholder("w"), g.placeholder("wl")
    x.meta["example_value"], w.meta["example_value"] = torch.randn(n, hidden), torch.randn(hidden)
    wl.meta["example_value"] = torch.randn(out, hidden)
    b = g.placeholder("b") if bias else None
    if b is not None:
        b.meta["example_value"] = torch.randn(out)

    def call(fn, args, path, cls, val):
        node = g.call_function(fn, args)
        node.meta["nn_module_stack"] = {path: (f"L['self'].{path}", cls)}
        node.meta["example_value"] = val
        return node

    h = call(norm_target, (x, w, 1e-5, None) if norm_target is rms_norm else (x, w),
             "layers.3.input_layernorm", RMSNorm, torch.randn(n, hidden))
    y = call(linear, (h, wl) + ((b,) if bias else ()), "layers.3.self_attn.qkv_proj", QKVParallelLinear,
             torch.randn(n, out))
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


def test_a_projection_with_a_bias_is_rmsnorm_linear_bias_and_records_the_bias(monkeypatch):
    regions, _ = find_regions(_graph(bias=True))
    rl = next(r for r in regions if r["kind"].startswith("rmsnorm_linear"))
    assert rl["kind"] == "rmsnorm_linear_bias" and rl["supported"] and rl["dims"] == {"hidden": 16, "out": 48}
    assert [ref.get("node", ref.get("param")) for ref in rl["inputs"]] == ["x", "w", "layers.3.self_attn.qkv_proj",
                                                                           "b"]
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    run = backend.capture_backend(fx.GraphModule(torch.nn.Module(), _graph(bias=True)), [])
    x, w, wl, b = torch.randn(5, 16), torch.rand(16), torch.randn(48, 16), torch.randn(48)
    backend.STATE.record_pending = 1
    run(x, w, wl, b)
    kinds = [r["kind"] for r in backend.STATE.regions]
    rec = backend.STATE.recorded[0][1][kinds.index("rmsnorm_linear_bias")]
    torch.testing.assert_close(rec["inputs"][:2] + rec["inputs"][-1:], [x, w, b])
    torch.testing.assert_close(rec["outputs"], [linear(rms_norm(x, w, 1e-5, None), wl, b)])


fused_add_rms_norm = torch.ops.vllm_ir.fused_add_rms_norm.default


def test_a_norm_that_adds_the_residual_feeding_a_projection_is_fused_add_rmsnorm_linear():
    import operator

    n, hidden, out = 3, 16, 40
    g = fx.Graph()
    x, res, w, wl = (g.placeholder(name) for name in ("x", "res", "w", "wl"))
    x.meta["example_value"] = res.meta["example_value"] = torch.randn(n, hidden)
    w.meta["example_value"], wl.meta["example_value"] = torch.randn(hidden), torch.randn(out, hidden)
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


class TPAwareRMSNorm:  # the Transformers backend's RMSNorm subclass (OLMo 2), by name only
    pass


@pytest.mark.parametrize("lead, rows_per_token", [((1, "tokens"), 1), (("tokens", 4), 4)])
def test_a_norm_of_any_class_is_found_by_its_op_with_rows_per_token(lead, rows_per_token):
    """A module holding vLLM's rms_norm op is a norm whatever its class; its input's leading dims
    other than the (symbolic) token dim are rows per token: [1, tokens, hidden] as vLLM's
    Transformers backend keeps it (1), [tokens, heads, head_dim] for a q/k norm (heads)."""
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    tokens = ShapeEnv().create_unbacked_symint()
    shape = tuple(tokens if d == "tokens" else d for d in lead) + (16,)
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["example_value"] = SimpleNamespace(shape=shape, dtype=torch.float32)
    w.meta["example_value"] = torch.randn(16)
    y = g.call_function(rms_norm, (x, w, 1e-6, None))
    y.meta.update(example_value=SimpleNamespace(shape=shape, dtype=torch.float32),
                  nn_module_stack={"layers.0.post_attention_layernorm": (
                      "L['self'].layers.0.post_attention_layernorm", TPAwareRMSNorm)})
    g.output(y)
    [region] = find_regions(g)[0]
    assert (region["kind"], region["supported"], region["eps"]) == ("rms_norm", True, 1e-6)
    assert region["dims"] == {"hidden": 16, "rows_per_token": rows_per_token}
    assert region["inputs"][0]["rows"] and region["outputs"][0]["rows"]


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


def test_rotary_is_a_supported_region_and_attention_is_reported_with_dims_and_a_reason():
    regions, _ = find_regions(_attention_graph())
    by_kind = {r["kind"]: r for r in regions}
    rot, attn = by_kind["rotary"], by_kind["attention"]
    assert rot["dims"] == {"heads": 4, "kv_heads": 2, "head_dim": 8, "rotary_dim": 8, "max_position": 64,
                           "neox": 1}
    assert attn["dims"] == {"heads": 4, "kv_heads": 2, "head_dim": 8}
    assert rot["supported"] and rot["reason"] is None and not attn["supported"] and rot["layer"] == attn["layer"] == 1
    assert "kv_len" in attn["reason"]
    # the rotary Program's inputs: q and k by head, positions as a column, the cache
    assert [ref.get("shape") for ref in rot["inputs"]] == [[-1, 4, 8], [-1, 2, 8], [-1, 1], None]
    assert "qk_norm_rotary" not in by_kind  # q and k are no norms' outputs here


def _qk_norm_rotary_graph(n=3, heads=4, kv=2, hd=8, k_eps=1e-6):
    """Qwen3's attention input as Dynamo traces it: q and k viewed by head, each RMSNorm'd (here prism's
    op, as the IR provider puts it in), viewed back, then vLLM's rotary op in place on both."""
    from prism_serve.patch import ops

    ops.define()
    g = fx.Graph()
    pos, q, k, cache, qw, kw = (g.placeholder(s) for s in ("positions", "q", "k", "cache", "qw", "kw"))
    for p, val in ((pos, torch.arange(n)), (q, torch.randn(n, heads * hd)), (k, torch.randn(n, kv * hd)),
                   (cache, torch.randn(64, hd)), (qw, torch.randn(hd)), (kw, torch.randn(hd))):
        p.meta["example_value"] = val

    def call(fn, args, path, cls, val=None, method=False):
        node = g.call_method(fn, args) if method else g.call_function(fn, args)
        node.meta["nn_module_stack"] = {path: (f"L['self'].{path}", cls)}
        node.meta["example_value"] = val
        return node

    attn = "layers.0.self_attn"
    normed = []
    for x, w, h, name, eps in ((q, qw, heads, "q_norm", 1e-6), (k, kw, kv, "k_norm", k_eps)):
        by_head = call("view", (x, n, h, hd), attn, object, torch.randn(n, h, hd), method=True)
        out = call(torch.ops.prism.rms_norm.default, (by_head, w, eps), f"{attn}.{name}", RMSNorm,
                   torch.randn(n, h, hd))
        normed.append(call("view", (out, n, h * hd), attn, object, torch.randn(n, h * hd), method=True))
    call(rotary_embedding, (pos, *normed, hd, cache, True), f"{attn}.rotary_emb", RotaryEmbedding)
    g.output(normed[0])
    return g


def test_qk_norms_before_rotary_are_one_qk_norm_rotary_region_beside_the_rotary():
    regions, _ = find_regions(_qk_norm_rotary_graph())
    by_kind = {r["kind"]: r for r in regions}
    rot, qk = by_kind["rotary"], by_kind["qk_norm_rotary"]
    assert qk["supported"] and qk["dims"] == rot["dims"] and qk["eps"] == 1e-6
    assert qk["modules"] == ["layers.0.self_attn.q_norm", "layers.0.self_attn.k_norm", "layers.0.self_attn.rotary_emb"]
    # the Program's inputs: the norms' inputs by head, their weights, positions, the cache
    assert [ref.get("shape") for ref in qk["inputs"]] == [[-1, 4, 8], [-1, 2, 8], None, None, [-1, 1], None]
    assert qk["outputs"] == rot["outputs"]
    regions, _ = find_regions(_qk_norm_rotary_graph(k_eps=1e-5))  # two epsilons: no QK-norm + rotary
    assert "qk_norm_rotary" not in {r["kind"] for r in regions}


def test_a_rotary_that_is_not_the_vllm_op_is_unsupported_without_dims():
    regions, _ = find_regions(_attention_graph(rotary_target=torch.neg))
    rot = next(r for r in regions if r["kind"] == "rotary")
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
    rot = recorded[kinds.index("rotary")]
    by_head = [q0.reshape(3, 4, 8), k0.reshape(3, 2, 8)]
    torch.testing.assert_close(rot["inputs"], [*by_head, pos.reshape(3, 1), cache])  # taken before the in-place op
    torch.testing.assert_close(rot["outputs"], [2 * by_head[0], 3 * by_head[1]])  # and after it
    attn = recorded[kinds.index("attention")]
    torch.testing.assert_close(attn["outputs"], [(2 * q0).reshape(3, 4, 8)])


def test_a_rotary_op_without_traced_shapes_is_unsupported_not_a_crash():
    g = _attention_graph()
    next(n for n in g.nodes if n.name == "cache").meta.pop("example_value")
    regions, _ = find_regions(g)
    rot = next(r for r in regions if r["kind"] == "rotary")
    assert rot["dims"] == {} and not rot["supported"] and "without tensor shapes" in rot["reason"]
    assert next(r for r in regions if r["kind"] == "attention")["dims"]  # the rest is still found


# --- the regions holding a projection, found by the fusion pass's matcher on Dynamo's graph ----------

class MergedColumnParallelLinear:
    pass


class SiluAndMul:
    pass


class GeluAndMul:
    pass


class GemmaRMSNorm:
    pass


def _post_attention_graph(act: str = "silu", gemm: str = "onednn", weight_dtype=None, n=3, hidden=16,
                          inter=24, offset: float | None = None, dtype=torch.float32):
    """A post-attention side as vLLM's CPU build traces it in Dynamo: residual add + RMSNorm (the IR op),
    gate_up as vLLM's in-place oneDNN call on its handle (`gemm="amx"`: its AMX call on the weight it
    packed; "linear": torch's linear), `act(x[..., :d]) * x[..., d:]`. Returns the graph and what
    it takes for the weight where that is not the weight (the handler, the packed weight).
    `act`: "silu", "gelu" (exact) or "gelu_tanh"; `offset`: a GemmaRMSNorm, whose IR op gets the
    weight `w.float() + offset` (Gemma's is 1.0)."""
    import operator

    from vllm import _custom_ops as vops

    weight_dtype = weight_dtype or dtype

    def rand(*shape):
        return torch.randn(*shape).to(dtype)

    g = fx.Graph()
    x, res, w, wl = (g.placeholder(name) for name in ("x", "res", "w", "wl"))
    weight = torch.randn(2 * inter, hidden).to(weight_dtype) / 4
    handler = vops.create_onednn_mm(weight.t(), 32) if gemm == "onednn" else None
    packed = torch.ops._C.convert_weight_packed(weight) if gemm == "amx" else None
    for p, val in ((x, rand(n, hidden)), (res, rand(n, hidden)), (w, rand(hidden)),
                   (wl, handler.handler_tensor if handler else packed if gemm == "amx" else weight)):
        p.meta["example_value"] = val

    def call(fn, args, path, cls, val, method=False, **kwargs):
        node = g.call_method(fn, args, kwargs) if method else g.call_function(fn, args, kwargs)
        node.meta.update(nn_module_stack={path: (f"L['self'].{path}", cls)}, example_value=val)
        return node

    norm_path, lin_path = "layers.0.post_attention_layernorm", "layers.0.mlp.gate_up_proj"
    act_path = "layers.0.mlp.act_fn"
    norm_cls, norm_w = (RMSNorm, w) if offset is None else (GemmaRMSNorm, None)
    if offset is not None:  # GemmaRMSNorm.forward_native: weight = self.weight.float() + 1.0
        wf = call("float", (w,), norm_path, norm_cls, torch.randn(hidden), method=True)
        norm_w = call(operator.add, (wf, offset), norm_path, norm_cls, torch.randn(hidden))
    op = call(fused_add_rms_norm, (x, res, norm_w, 1e-6, None), norm_path, norm_cls, None)
    y, s = (call(operator.getitem, (op, i), norm_path, norm_cls, rand(n, hidden)) for i in (0, 1))
    if gemm == "onednn":
        c = call(torch.empty, ((n, 2 * inter),), lin_path, MergedColumnParallelLinear, rand(n, 2 * inter))
        a = call("reshape", (y, -1, hidden), lin_path, MergedColumnParallelLinear, rand(n, hidden), method=True)
        call(torch.ops._C.onednn_mm, (c, a, None, wl), lin_path, MergedColumnParallelLinear, None)
    elif gemm == "amx":  # vLLM's weight_packed_linear_cpu: the call writes a view of a fresh buffer
        c = call(torch.empty, ((n, 2 * inter),), lin_path, MergedColumnParallelLinear, rand(n, 2 * inter), dtype=dtype)
        cv = call("reshape", (c, -1, 2 * inter), lin_path, MergedColumnParallelLinear, rand(n, 2 * inter), method=True)
        a = call("reshape", (y, -1, hidden), lin_path, MergedColumnParallelLinear, rand(n, hidden), method=True)
        call(torch.ops._C.weight_packed_linear, (cv, a, wl, None, True), lin_path, MergedColumnParallelLinear, None)
    else:
        c = call(linear, (y, wl), lin_path, MergedColumnParallelLinear, torch.randn(n, 2 * inter).to(weight_dtype))
    cls = SiluAndMul if act == "silu" else GeluAndMul
    gate = call(operator.getitem, (c, (Ellipsis, slice(None, inter))), act_path, cls, rand(n, inter))
    up = call(operator.getitem, (c, (Ellipsis, slice(inter, None))), act_path, cls, rand(n, inter))
    if act == "gelu_tanh":  # GeluAndMul(approximate="tanh"), as Dynamo traces F.gelu
        h = call(torch._C._nn.gelu, (gate,), act_path, cls, rand(n, inter), approximate="tanh")
    else:
        fn = torch.nn.functional.silu if act == "silu" else torch.nn.functional.gelu
        h = call(fn, (gate,), act_path, cls, rand(n, inter))
    out = call(operator.mul, (h, up), act_path, cls, rand(n, inter))
    g.output((out, s))
    return g, packed if gemm == "amx" else handler


def _projection_kinds(graph) -> dict[str, dict]:
    from prism_serve.capture.regions import projection_regions
    return {r["kind"]: r for r in projection_regions(graph)}


def test_capture_reports_the_regions_the_pass_would_replace_on_vllms_onednn_call(monkeypatch):
    g, handler = _post_attention_graph()
    regions, _ = find_regions(g)
    kinds = sorted(r["kind"] for r in regions if r["supported"])
    assert kinds == ["fused_add_rms_norm", "fused_add_rmsnorm_linear", "rmsnorm_swiglu", "silu_and_mul", "swiglu"]
    rs = next(r for r in regions if r["kind"] == "rmsnorm_swiglu")
    assert rs["modules"] == ["layers.0.post_attention_layernorm", "layers.0.mlp.gate_up_proj", "layers.0.mlp.act_fn"]
    assert rs["dims"] == {"hidden": 16, "intermediate": 24} and rs["eps"] == 1e-6 and rs["layer"] == 0
    assert rs["inputs"][2:] == [{"param": "layers.0.mlp.gate_up_proj", "span": [0, 24]},
                                {"param": "layers.0.mlp.gate_up_proj", "span": [24, 48]}]
    # the recorder reads the region's values where the refs say, around vLLM's in-place GEMM
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    gm = fx.GraphModule(torch.nn.Module(), g)
    run = backend.capture_backend(gm, [])
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    backend.STATE.record_pending = 1
    want, s = run(x, res, w, handler.handler_tensor)
    recorded = backend.STATE.recorded[0][1]
    got = recorded[[r["kind"] for r in backend.STATE.regions].index("rmsnorm_swiglu")]
    torch.testing.assert_close(got["inputs"][0], x + res)  # the residual sum the region starts from
    torch.testing.assert_close(got["outputs"], [want])


def test_capture_reports_the_same_regions_on_vllms_amx_call(monkeypatch):
    """Small bf16 weights on an AMX machine: vLLM packs them for its AMX GEMM, whose call writes
    `out.reshape(-1, n)` of a fresh buffer `out` that later ops read."""
    pytest.importorskip("vllm._custom_ops")  # loads vLLM's `_C` ops
    if not (hasattr(torch.ops._C, "weight_packed_linear") and torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's AMX GEMM needs an AMX CPU")
    g, packed = _post_attention_graph(gemm="amx", dtype=torch.bfloat16, hidden=32)
    regions, _ = find_regions(g)
    kinds = sorted(r["kind"] for r in regions if r["supported"])
    assert kinds == ["fused_add_rms_norm", "fused_add_rmsnorm_linear", "rmsnorm_swiglu", "silu_and_mul", "swiglu"]
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    run = backend.capture_backend(fx.GraphModule(torch.nn.Module(), g), [])
    x, res, w = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((3, 32), (3, 32), (32,)))
    backend.STATE.record_pending = 1
    want, _ = run(x, res, w, packed)
    recorded = backend.STATE.recorded[0][1]
    got = recorded[[r["kind"] for r in backend.STATE.regions].index("rmsnorm_swiglu")]
    torch.testing.assert_close(got["inputs"][0], x + res)
    torch.testing.assert_close(got["outputs"], [want])
    swiglu = recorded[[r["kind"] for r in backend.STATE.regions].index("swiglu")]
    assert swiglu["inputs"][0].shape == (3, 32)  # gate_up's input, read before the call


def test_capture_reports_no_swiglu_region_for_another_activation():
    kinds = _projection_kinds(_post_attention_graph(act="gelu")[0])
    assert set(kinds) == {"fused_add_rmsnorm_linear"}  # the norm and the projection, but no SiLU region


def test_capture_reports_a_projection_whose_weight_is_not_the_activation_dtype_unsupported():
    kinds = _projection_kinds(_post_attention_graph(gemm="linear", weight_dtype=torch.bfloat16)[0])
    assert kinds and all(not r["supported"] and "bfloat16" in r["reason"] for r in kinds.values())
    assert _projection_kinds(_post_attention_graph(gemm="linear")[0]).keys() == {
        "fused_add_rmsnorm_linear", "rmsnorm_swiglu", "swiglu"}


# --- Gemma: GeluAndMul(approximate="tanh") and GemmaRMSNorm (its IR op on w.float() + 1.0) ----------

def test_gate_up_and_tanh_gelu_mul_are_geglu_and_with_the_norm_rmsnorm_geglu(monkeypatch):
    g, handler = _post_attention_graph(act="gelu_tanh")
    regions, _ = find_regions(g)
    kinds = {r["kind"]: r for r in regions if r["supported"]}
    assert sorted(kinds) == ["fused_add_rms_norm", "fused_add_rmsnorm_linear", "geglu", "gelu_tanh_and_mul",
                             "rmsnorm_geglu"]
    assert kinds["rmsnorm_geglu"]["modules"] == ["layers.0.post_attention_layernorm", "layers.0.mlp.gate_up_proj",
                                                 "layers.0.mlp.act_fn"]
    gg = kinds["geglu"]
    assert gg["modules"] == ["layers.0.mlp.gate_up_proj", "layers.0.mlp.act_fn"]
    assert gg["dims"] == {"hidden": 16, "intermediate": 24} and gg["eps"] is None
    assert kinds["gelu_tanh_and_mul"]["dims"] == {"intermediate": 24}
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    run = backend.capture_backend(fx.GraphModule(torch.nn.Module(), g), [])
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16)
    backend.STATE.record_pending = 1
    want, _ = run(x, res, w, handler.handler_tensor)
    names = [r["kind"] for r in backend.STATE.regions]
    act = backend.STATE.recorded[0][1][names.index("gelu_tanh_and_mul")]
    gate, up = act["inputs"]
    torch.testing.assert_close(torch.nn.functional.gelu(gate, approximate="tanh") * up, want)
    torch.testing.assert_close(act["outputs"], [want])
    whole = backend.STATE.recorded[0][1][names.index("rmsnorm_geglu")]
    torch.testing.assert_close(whole["inputs"][0], x + res)  # the residual sum the region starts from
    torch.testing.assert_close(whole["outputs"], [want])


def test_exact_gelu_is_reported_unsupported_not_as_geglu():
    regions, _ = find_regions(_post_attention_graph(act="gelu")[0])
    gelu = [r for r in regions if r["modules"] == ["layers.0.mlp.act_fn"]]
    assert [(r["kind"], r["supported"]) for r in gelu] == [("gelu_and_mul", False)] and "tanh" in gelu[0]["reason"]
    assert "geglu" not in {r["kind"] for r in regions}


def _recorded(monkeypatch, g: fx.Graph, kind: str, *inputs) -> dict:
    """What the capture backend records for the region `kind` of `g` on one forward of `inputs`."""
    monkeypatch.setattr(backend, "STATE", backend.CaptureState())
    run = backend.capture_backend(fx.GraphModule(torch.nn.Module(), g), [])
    backend.STATE.record_pending = 1
    run(*inputs)
    names = [r["kind"] for r in backend.STATE.regions]
    return backend.STATE.recorded[0][1][names.index(kind)]


def test_gemma_norm_is_reported_with_its_stored_weight(monkeypatch):
    g, handler = _post_attention_graph(act="gelu_tanh", offset=1.0)
    regions, _ = find_regions(g)
    norm = next(r for r in regions if r["modules"] == ["layers.0.post_attention_layernorm"])
    assert norm["kind"] == "gemma_fused_add_rms_norm" and norm["supported"] and norm["dims"] == {"hidden": 16}
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16) - 0.5
    rec = _recorded(monkeypatch, g, "gemma_fused_add_rms_norm", x, res, w, handler.handler_tensor)
    torch.testing.assert_close(rec["inputs"], [x, res, w])  # the stored weight, not w + 1
    s = x + res
    want = torch.nn.functional.rms_norm(s, (16,), 1 + w, 1e-6)
    torch.testing.assert_close(rec["outputs"], [want, s])


def test_a_norm_weight_offset_other_than_one_is_not_gemmas(monkeypatch):
    """Gemma's kinds are the norm op on a stored weight + 1; a norm op on any other computed weight is
    a plain norm of that weight, whatever the module's class, and records the weight the op reads."""
    g, handler = _post_attention_graph(act="gelu_tanh", offset=2.0)
    regions, _ = find_regions(g)
    norm = next(r for r in regions if r["modules"] == ["layers.0.post_attention_layernorm"])
    assert norm["kind"] == "fused_add_rms_norm" and norm["supported"]
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16) - 0.5
    rec = _recorded(monkeypatch, g, "fused_add_rms_norm", x, res, w, handler.handler_tensor)
    torch.testing.assert_close(rec["inputs"], [x, res, w + 2.0])


def test_a_half_precision_gemma_norm_gives_the_gemma_kinds_on_the_stored_weight(monkeypatch):
    """fp16 / bf16 Gemma: the op's weight w.float() + 1.0 is float32, not x's dtype, so the norm is
    Gemma's (not a plain norm of another dtype's weight) and the regions it starts are the `gemma_`
    kinds, which record the stored weight; in float32 they are the plain kinds (the tests above)."""
    gemm = "onednn" if onednn_handles(torch.float16) else "linear"  # what vLLM runs on this CPU
    g, handler = _post_attention_graph(act="gelu_tanh", gemm=gemm, offset=1.0, dtype=torch.float16)
    regions, _ = find_regions(g)
    kinds = {r["kind"]: r for r in regions if r["supported"]}
    assert set(kinds) == {"gemma_fused_add_rms_norm", "gemma_fused_add_rmsnorm_linear", "gemma_rmsnorm_geglu",
                          "geglu", "gelu_tanh_and_mul"}, [(r["kind"], r["reason"]) for r in regions]
    assert kinds["gemma_rmsnorm_geglu"]["dims"] == {"hidden": 16, "intermediate": 24}
    x, res, w = torch.randn(3, 16).half(), torch.randn(3, 16).half(), (torch.rand(16) - 0.5).half()
    weight = handler.handler_tensor if handler else g.find_nodes(op="placeholder")[3].meta["example_value"]
    rec = _recorded(monkeypatch, g, "gemma_fused_add_rmsnorm_linear", x, res, w, weight)
    torch.testing.assert_close(rec["inputs"][:3], [x, res, w])  # the stored weight, in its own dtype


class MoERunner:  # vLLM's FusedMoE runner, whose forward runs the CPU fused MoE op
    pass


def _experts_graph(act: str, w13_shape=(4, 2 * 24, 16)):
    """A layer's routed experts as vLLM's CPU build traces them: `_C.cpu_fused_moe(out, x, w13, w2,
    w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa)`."""
    import vllm._custom_ops  # noqa: F401 - registers the _C ops

    g = fx.Graph()
    vals = {"out": torch.empty(5, 16), "x": torch.randn(5, 16), "w13": torch.randn(*w13_shape),
            "w2": torch.randn(4, 16, 24), "topk_weights": torch.rand(5, 2), "topk_ids": torch.zeros(5, 2, dtype=torch.int32)}
    ph = {}
    for name, v in vals.items():
        ph[name] = g.placeholder(name)
        ph[name].meta["example_value"] = v
    node = g.call_function(torch.ops._C.cpu_fused_moe.default, (ph["out"], ph["x"], ph["w13"], ph["w2"], None, None,
                                                                 ph["topk_weights"], ph["topk_ids"], False, act, "vec"))
    node.meta["nn_module_stack"] = {"layers.2.mlp.experts": ("L['self'].layers.2.mlp.experts", MoERunner)}
    g.output(ph["out"])
    return g


def test_a_layers_routed_experts_are_found_by_activation_with_their_dims_and_refs():
    """The op's x, routing and output as the Program takes them (x [T, 1, 1, 1, H], int32 ids, the
    weights [T, k, 1, 1, 1] in x's dtype), and the stacked weights read from the plain copy the
    capture child keeps (vLLM packs the ones the op is traced with), in the Program's order."""
    (r,) = find_regions(_experts_graph("silu"))[0]
    assert (r["kind"], r["layer"], r["modules"]) == ("moe_experts", 2, ["layers.2.mlp.experts"])
    assert r["dims"] == {"num_experts": 4, "top_k": 2, "hidden": 16, "intermediate": 24}
    assert r["supported"] and r["reason"] is None
    op = "cpu_fused_moe_default"
    assert r["inputs"] == [
        {"node": "x", "at": op, "when": "before", "shape": [-1, 1, 1, 1, 16]},
        {"node": "topk_ids", "at": op, "when": "before", "dtype": "int32"},
        {"node": "topk_weights", "at": op, "when": "before", "shape": [-1, 2, 1, 1, 1], "dtype": "float32"},
        {"param": "layers.2.mlp.experts.w13_weight", "shape": [4, 2, 24, 16]},
        {"param": "layers.2.mlp.experts.w2_weight", "shape": [4, 1, 16, 24]}]
    assert r["outputs"] == [{"node": "out", "at": op, "when": "after", "shape": [-1, 1, 1, 1, 16]}]
    assert [n.name for n in KINDS["moe_experts"].program(r["dims"], "float32").inputs] == [
        "x", "topk_ids", "topk_weights", "w13", "w2"]
    (g,) = find_regions(_experts_graph("gelu_tanh"))[0]
    assert g["kind"] == "moe_experts_gelu_tanh" and g["supported"]
    # weights packed into another shape: no dims are read from them, and nothing is recorded
    (packed,) = find_regions(_experts_graph("silu", w13_shape=(4, 16, 48)))[0]
    assert packed["dims"] == {} and not packed["supported"] and not packed["inputs"]
    assert "(4, 16, 48)" in packed["reason"]
    (other,) = find_regions(_experts_graph("swigluoai"))[0]
    assert not other["supported"] and "'swigluoai' activation" in other["reason"]
