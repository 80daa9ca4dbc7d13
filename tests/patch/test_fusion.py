"""The fusion pass's patterns on hand-written FX graphs, in the form Inductor hands a post-grad
pass (make_fx with Inductor's decompositions, symbolic num_tokens): each region kind is replaced
by its prism op when the table has a kernel for it, and left alone on a near miss. The rewritten
graph must compute what the original did (the prism ops run their torch fallback here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from prism_serve.patch import fusion, ops, patterns
from prism_serve.patch.table import Buckets, Table

vllm_ir = pytest.importorskip("vllm.ir")
F32, EPS = torch.float32, 1e-6
H, INTER, QKV = 24, 40, 56  # awkward sizes, none a power of two
native_rms = vllm_ir.ops.rms_norm.impls["native"].impl_fn
native_add_rms = vllm_ir.ops.fused_add_rms_norm.impls["native"].impl_fn


def table(*entries, device: str = "cpu") -> Table:
    """A dispatch table holding (op, key) entries (the pass reads only which keys exist)."""
    t = Table(device)
    for op, key in entries:
        t.ops.setdefault(op, {})[key] = Buckets()
    return t


def graph_of(fn, *args):
    ops.define_ops()
    return make_fx(fn, select_decomp_table(), tracing_mode="symbolic")(*args)


def rewrite(fn, args, tab: Table):
    """(replaced kinds, prism op names left in the graph) after the pass, checking the rewritten
    graph still computes `fn` (torch on the same inputs) for 1 and 7 tokens."""
    gm = graph_of(fn, *args)
    done = fusion.rewrite(gm.graph, tab)
    gm.recompile()
    for rows in (1, 7):
        fresh = [torch.randn(rows, *a.shape[1:]) if a.dim() == 2 and a.shape[0] == args[0].shape[0] else a
                 for a in args]
        want, got = fn(*fresh), gm(*fresh)
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                        strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    left = {n.target._opname for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "prism"}
    return dict(done), left


def x_(rows=3, dim=H):
    return torch.randn(rows, dim)


def w_(*shape, dtype=F32):
    return (torch.randn(*shape) * shape[-1] ** -0.5).to(dtype)


# --- residual add + RMSNorm -------------------------------------------------------------

ADD_RMS = ("fused_add_rms_norm", (F32, H, EPS))


def test_residual_add_rmsnorm_becomes_one_prism_op():
    def fn(x, r, g):
        return native_add_rms(x, r, g, EPS)
    assert rewrite(fn, [x_(), x_(), w_(H)], table(ADD_RMS)) == ({"fused_add_rms_norm": 1}, {"fused_add_rms_norm"})


def test_residual_first_add_and_a_decoder_sum_match_too():
    def fn(x, r, g):  # residual + x written by hand, as a decoder layer would
        s = r + x
        return native_rms(s, g, EPS), s
    assert rewrite(fn, [x_(), x_(), w_(H)], table(ADD_RMS))[0] == {"fused_add_rms_norm": 1}


@pytest.mark.parametrize("near_miss", ["other epsilon", "epsilon from a tensor", "weight of another dtype",
                                       "no kernel for the size", "kernels for another device"])
def test_residual_add_rmsnorm_near_misses_stay_vllms(near_miss):
    tab = table(ADD_RMS, device="cuda" if near_miss == "kernels for another device" else "cpu")
    args = [x_(), x_(), w_(H)]
    if near_miss == "other epsilon":
        def fn(x, r, g):
            return native_add_rms(x, r, g, 1e-5)
    elif near_miss == "epsilon from a tensor":
        def fn(x, r, g, eps):
            s = x + r
            y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
            return y * g, s
        args.append(torch.full((1,), EPS))
    elif near_miss == "weight of another dtype":  # a low-precision weight: vLLM's body casts to it
        def fn(x, r, g):
            return native_add_rms(x, r, g, EPS)
        args[2] = w_(H, dtype=torch.float16)
    elif near_miss == "no kernel for the size":
        def fn(x, r, g):
            return native_add_rms(x, r, g, EPS)
        args = [x_(dim=H + 8), x_(dim=H + 8), w_(H + 8)]
    else:
        def fn(x, r, g):
            return native_add_rms(x, r, g, EPS)
    assert rewrite(fn, args, tab) == ({}, set())


# --- RMSNorm (+ projection) ----------------------------------------------------------------

def test_rmsnorm_alone_and_in_vllm_ir_form():
    def native(x, g):
        return native_rms(x, g, EPS)

    def ir_form(x, g):  # what VLLM_COMPILE's pass manager holds before vLLM lowers its IR
        with vllm_ir.enable_torch_wrap(True):
            return vllm_ir.ops.rms_norm(x, g, EPS)
    tab = table(("rms_norm", (F32, H, EPS)))
    assert rewrite(native, [x_(), w_(H)], tab)[0] == {"rms_norm": 1}
    assert rewrite(ir_form, [x_(), w_(H)], tab)[0] == {"rms_norm": 1}
    assert rewrite(native, [x_(), w_(H)], table(("rms_norm", (F32, H, 1e-5))))[0] == {}  # other epsilon


NORM_LINEAR = ("rmsnorm_linear", (F32, (H, QKV), EPS))


def test_rmsnorm_then_projection_becomes_rmsnorm_linear():
    def fn(x, g, w):
        return F.linear(native_rms(x, g, EPS), w)
    assert rewrite(fn, [x_(), w_(H), w_(QKV, H)], table(NORM_LINEAR)) == ({"rmsnorm_linear": 1}, {"rmsnorm_linear"})


def test_a_norm_that_also_feeds_another_consumer_is_not_fused_into_the_projection():
    def fn(x, g, w):
        y = native_rms(x, g, EPS)
        return F.linear(y, w), y  # the normed tensor is needed outside the region
    assert rewrite(fn, [x_(), w_(H), w_(QKV, H)], table(NORM_LINEAR))[0] == {}


@pytest.mark.parametrize("near_miss", ["bias", "weight of another dtype", "other projection size"])
def test_rmsnorm_projection_near_misses_stay_vllms(near_miss):
    args = [x_(), w_(H), w_(QKV, H)]
    if near_miss == "bias":  # no prism kernel kind takes a bias yet: addmm is not a pattern
        def fn(x, g, w, b):
            return F.linear(native_rms(x, g, EPS), w, b)
        args.append(w_(QKV))
    elif near_miss == "weight of another dtype":  # a quantized stand-in: the activation is cast to it
        def fn(x, g, w):
            return F.linear(native_rms(x, g, EPS).to(torch.bfloat16), w).float()
        args[2] = w_(QKV, H, dtype=torch.bfloat16)
    else:
        def fn(x, g, w):
            return F.linear(native_rms(x, g, EPS), w)
        args[2] = w_(QKV + 8, H)
    assert rewrite(fn, args, table(NORM_LINEAR)) == ({}, set())


def test_the_key_rejects_a_weight_whose_dtype_differs_from_the_activation():
    # where the structure matches, the key is what keeps a mixed-dtype weight out
    p = patterns.rmsnorm_linear(F32, EPS)
    vals = {"x": x_(), "norm_weight": w_(H), "weight": w_(QKV, H)}
    assert p.key(vals) == (F32, (H, QKV), EPS)
    assert p.key(vals | {"weight": w_(QKV, H, dtype=torch.bfloat16)}) is None
    assert patterns.swiglu(F32, INTER).key({"x": x_(), "w_gate_up": w_(2 * INTER, H, dtype=torch.int8)}) is None


# --- gate_up projection + SiLU*mul ---------------------------------------------------------

SWIGLU = ("swiglu", (F32, (H, INTER), None))
SILU = ("silu_and_mul", (F32, INTER, None))


def gate_up_silu(x, w):
    gu = F.linear(x, w)
    return F.silu(gu[..., :INTER]) * gu[..., INTER:]


def test_gate_up_and_silu_mul_become_swiglu():
    assert rewrite(gate_up_silu, [x_(), w_(2 * INTER, H)], table(SWIGLU, SILU)) == ({"swiglu": 1}, {"swiglu"})


def test_silu_mul_alone_when_only_the_activation_has_a_kernel():
    assert rewrite(gate_up_silu, [x_(), w_(2 * INTER, H)], table(SILU)) == ({"silu_and_mul": 1}, {"silu_and_mul"})


@pytest.mark.parametrize("near_miss", ["bias", "other intermediate size"])
def test_gate_up_near_misses_stay_vllms(near_miss):
    if near_miss == "bias":
        def fn(x, w, b):
            gu = F.linear(x, w, b)
            return F.silu(gu[..., :INTER]) * gu[..., INTER:]
        args = [x_(), w_(2 * INTER, H), w_(2 * INTER)]
        assert rewrite(fn, args, table(SWIGLU)) == ({}, set())
    else:
        assert rewrite(gate_up_silu, [x_(), w_(2 * INTER, H)], table(("swiglu", (F32, (H, INTER + 8), None)))) == (
            {}, set())


# --- a decoder layer: larger regions first ------------------------------------------------

def test_a_decoder_layer_is_served_region_by_region():
    def layer(x, r, g1, wqkv, g2, wgu):
        y, s = native_add_rms(x, r, g1, EPS)
        attn = F.linear(y, wqkv)[:, :H]  # stands in for attention
        h, s2 = native_add_rms(attn, s, g2, EPS)
        return gate_up_silu(h, wgu), s2
    args = [x_(), x_(), w_(H), w_(QKV, H), w_(H), w_(2 * INTER, H)]
    done, _ = rewrite(layer, args, table(ADD_RMS, NORM_LINEAR, SWIGLU, SILU))
    # the input norm goes with its projection (the residual add stays an add), the MLP is one kernel
    assert done == {"rmsnorm_linear": 1, "fused_add_rms_norm": 1, "swiglu": 1}
    assert rewrite(layer, args, table(ADD_RMS, SILU))[0] == {"fused_add_rms_norm": 2, "silu_and_mul": 1}


# --- the pass in vLLM's config and its cache key ---------------------------------------------

def test_uuid_follows_the_table_keys_and_changes_vllms_compile_hash(monkeypatch):
    from vllm.config import CompilationConfig

    def config_hash(t):
        monkeypatch.setattr(ops.STATE, "table", t)
        cc = CompilationConfig(mode=3, inductor_compile_config={"post_grad_custom_post_pass": fusion.PrismFusionPass()})
        return fusion.PrismFusionPass().uuid(), cc.compute_hash()

    a, same_keys, other = table(ADD_RMS), table(ADD_RMS), table(ADD_RMS, SILU)
    same_keys.ops["fused_add_rms_norm"][ADD_RMS[1]].los.append(1)  # another kernel for the same key
    assert config_hash(a) == config_hash(same_keys)
    assert config_hash(a)[0] != config_hash(other)[0] and config_hash(a)[1] != config_hash(other)[1]


def test_the_pass_travels_to_vllms_workers_and_copies():
    # vLLM pickles its config to the engine and worker processes; VllmBackend deep-copies the pass
    import copy
    import pickle

    from vllm.compilation.passes.inductor_pass import InductorPass
    p = fusion.PrismFusionPass()
    assert isinstance(p, InductorPass)  # vLLM's pass manager accepts only InductorPass
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert isinstance(q, fusion.PrismFusionPass) and q.uuid() == p.uuid()


def test_the_pass_goes_where_inductor_compiles_and_leaves_a_users_pass_alone():
    from vllm.compilation.passes.inductor_pass import CallableInductorPass
    from vllm.config import CompilationConfig

    key = "post_grad_custom_post_pass"
    compiled = CompilationConfig(mode=2, backend="inductor")
    assert fusion.add_to(compiled, key) and isinstance(compiled.inductor_compile_config[key], fusion.PrismFusionPass)
    assert not fusion.add_to(CompilationConfig(mode=0), key)
    assert not fusion.add_to(CompilationConfig(mode=2, backend="eager"), key)
    theirs = CallableInductorPass(lambda graph: None, uuid="theirs")
    user = CompilationConfig(mode=2, backend="inductor", inductor_compile_config={key: theirs})
    assert not fusion.add_to(user, key) and user.inductor_compile_config[key] is theirs
