"""The fusion pass on Gemma's forms, on hand-written FX graphs as Inductor hands them to a post-grad
pass: GemmaRMSNorm (vLLM's RMSNorm ops on `w.float() + 1.0`) becomes `prism::gemma_rms_norm` /
`prism::gemma_fused_add_rms_norm` on the stored weight, GeluAndMul(approximate="tanh") after gate_up
becomes `prism::geglu`; near misses stay vLLM's. The rewritten graph must compute what the original
did (the prism ops run their torch fallback here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..cpu_gemm import onednn_handles
from .test_fusion import EPS, F32, GEMMS, H, INTER, NORM_LINEAR, QKV, Proj, native_add_rms, native_rms, rewrite, \
    table, vllm_ir, w_, x_

GEMMA_RMS = ("gemma_rms_norm", (F32, H, EPS))
GEMMA_ADD_RMS = ("gemma_fused_add_rms_norm", (F32, H, EPS))
GEGLU = ("geglu", (F32, (H, INTER), None))
GELU = ("gelu_tanh_and_mul", (F32, INTER, None))
NORM_GEGLU = ("rmsnorm_geglu", (F32, (H, INTER), EPS))


def _gemma_norm(offset=1.0, eps=EPS):
    def norm(x, w):  # GemmaRMSNorm.forward_native without residual
        return native_rms(x, w.float() + offset, eps)
    return norm


def _gemma_add_norm(offset=1.0, eps=EPS):
    def norm(x, r, w):
        return native_add_rms(x, r, w.float() + offset, eps)
    return norm


gemma_norm, gemma_add_norm = _gemma_norm(), _gemma_add_norm()


def gelu_mul(gu, approximate="tanh"):
    """GeluAndMul.forward_native."""
    return F.gelu(gu[..., :INTER], approximate=approximate) * gu[..., INTER:]


def test_gemma_norms_become_prism_ops_on_the_stored_weight():
    assert rewrite(gemma_norm, [x_(), w_(H)], table(GEMMA_RMS)) == ({"gemma_rms_norm": 1}, {"gemma_rms_norm"})
    got = rewrite(gemma_add_norm, [x_(), x_(), w_(H)], table(GEMMA_ADD_RMS))
    assert got == ({"gemma_fused_add_rms_norm": 1}, {"gemma_fused_add_rms_norm"})

    def ir_form(x, w):  # what VLLM_COMPILE's pass manager holds before vLLM lowers its IR
        with vllm_ir.enable_torch_wrap(True):
            return vllm_ir.ops.rms_norm(x, w.float() + 1.0, EPS)
    assert rewrite(ir_form, [x_(), w_(H)], table(GEMMA_RMS))[0] == {"gemma_rms_norm": 1}


@pytest.mark.parametrize("near_miss", ["plain RMSNorm", "offset 2", "other epsilon"])
def test_gemma_norm_near_misses_stay_vllms(near_miss):
    args = [x_(), x_(), w_(H)]
    if near_miss == "plain RMSNorm":  # x * w: a Gemma kernel would compute x * (1 + w)
        def fn(x, r, w):
            return native_add_rms(x, r, w, EPS)
    elif near_miss == "offset 2":
        def fn(x, r, w):
            return _gemma_add_norm(offset=2.0)(x, r, w)
    else:
        def fn(x, r, w):
            return _gemma_add_norm(eps=1e-5)(x, r, w)
    assert rewrite(fn, args, table(GEMMA_ADD_RMS, GEMMA_RMS)) == ({}, set())


@pytest.mark.parametrize("gemm", GEMMS)
def test_gate_up_and_tanh_gelu_mul_become_geglu(gemm):
    gate_up = Proj(gemm, 2 * INTER)

    def fn(x, w):
        return gelu_mul(gate_up(x, w))
    assert rewrite(fn, [x_(), gate_up.arg], table(GEGLU)) == ({"geglu": 1}, {"geglu"})
    assert rewrite(fn, [x_(), gate_up.arg], table(GELU)) == ({"gelu_tanh_and_mul": 1}, {"gelu_tanh_and_mul"})


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("near_miss", ["exact GELU", "SiLU under a GeGLU kernel", "other size"])
def test_geglu_near_misses_stay_vllms(gemm, near_miss):
    gate_up = Proj(gemm, 2 * INTER)
    tab = table(GEGLU, GELU)
    if near_miss == "exact GELU":
        def fn(x, w):
            return gelu_mul(gate_up(x, w), approximate="none")
    elif near_miss == "SiLU under a GeGLU kernel":
        def fn(x, w):
            gu = gate_up(x, w)
            return F.silu(gu[..., :INTER]) * gu[..., INTER:]
    else:
        def fn(x, w):
            return gelu_mul(gate_up(x, w))
        tab = table(("geglu", (F32, (H, INTER + 8), None)))
    assert rewrite(fn, [x_(), gate_up.arg], tab) == ({}, set())


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_gemma_layer_is_served_and_its_norm_before_qkv_keeps_its_computed_weight(gemm):
    """Gemma's decoder: the input norm + qkv is an RMSNorm + projection region on the weight vLLM
    computes (w + 1); the post-attention norm, which feeds GeGLU's projection, is a Gemma norm on
    the stored weight with gate_up + GeGLU one kernel, or with a kernel for all three (rmsnorm_geglu)
    one region; the final norm is a Gemma norm."""
    qkv, gate_up = Proj(gemm, QKV), Proj(gemm, 2 * INTER)

    def layer(x, r, g1, wq, g2, wg, g3):
        h, s = gemma_add_norm(x, r, g1)
        attn = qkv(h, wq)[:, :H]  # stands in for attention
        h, s = gemma_add_norm(attn, s, g2)
        m = gelu_mul(gate_up(h, wg))[:, :H]  # stands in for down_proj
        return gemma_add_norm(m, s, g3)[0]  # the final norm
    args = [x_(), x_(), w_(H), qkv.arg, w_(H), gate_up.arg, w_(H)]
    every = table(("fused_add_rmsnorm_linear", (F32, (H, QKV), EPS)), GEGLU, GEMMA_ADD_RMS)
    done, left = rewrite(layer, args, every)
    assert done == {"fused_add_rmsnorm_linear": 1, "geglu": 1, "gemma_fused_add_rms_norm": 2}
    assert left == {"fused_add_rmsnorm_linear", "geglu", "gemma_fused_add_rms_norm"}
    # the region takes the norm with the weight vLLM computes, never the raw one: with only the
    # plain rmsnorm_linear kernel, the residual add runs beside it, still on w + 1
    done, _ = rewrite(layer, args, table(NORM_LINEAR))
    assert done == {"rmsnorm_linear": 1}
    # with a kernel for the post-attention norm + gate_up + GeGLU, that is one region (its residual
    # add beside it) and the MLP's own geglu kernel stays unused
    done, left = rewrite(layer, args, table(("fused_add_rmsnorm_linear", (F32, (H, QKV), EPS)), GEGLU, GEMMA_ADD_RMS,
                                            NORM_GEGLU))
    assert done == {"fused_add_rmsnorm_linear": 1, "rmsnorm_geglu": 1, "gemma_fused_add_rms_norm": 1}
    assert left == {"fused_add_rmsnorm_linear", "rmsnorm_geglu", "gemma_fused_add_rms_norm"}


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_norm_weight_computed_after_the_sum_still_gives_the_region(gemm):
    """Inductor's graph of tiny Gemma computed w + 1 after the residual sum: the op-form replacement,
    placed where its match began, came before its own weight input, and the region check (which
    reads graph order) refused layer 1's input norm + qkv until the pass re-sorted the graph."""
    qkv = Proj(gemm, QKV)

    def fn(x, r, w, wq):  # vLLM's native residual add + RMSNorm body, the weight's offset in the middle
        s = x + r
        y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS)
        w1 = w.float() + 1.0
        return qkv(y * w1, wq), s
    args = [x_(), x_(), w_(H), qkv.arg]
    tab = table(("fused_add_rmsnorm_linear", (F32, (H, QKV), EPS)))
    assert rewrite(fn, args, tab) == ({"fused_add_rmsnorm_linear": 1}, {"fused_add_rmsnorm_linear"})


F16 = torch.float16


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_half_precision_gemma_layer_is_served_on_the_stored_norm_weight(gemm):
    """fp16 / bf16 Gemma: vLLM's norm weight w.float() + 1 is float32, not the activations' dtype, so
    no plain region takes the norm (their kernels multiply by a weight of x's dtype); the `gemma_`
    kinds take it on the stored weight: layer 0's input norm + qkv, a later layer's residual add +
    norm + qkv, the norm before the MLP with gate_up + GeGLU, and the final norm as the Gemma op."""
    if gemm == "onednn" and not onednn_handles(F16):
        pytest.skip("oneDNN has no float16 matmul on this CPU: vLLM runs torch's linear (the 'mm' case)")
    qkv, gate_up = Proj(gemm, QKV, F16), Proj(gemm, 2 * INTER, F16)

    def layers(x, g0, wq, g1, wg, g2, g3):
        h = gemma_norm(x, g0)  # layer 0's input norm: no residual yet
        a = qkv(h, wq)[:, :H]  # stands in for attention
        h, s = gemma_add_norm(a, x, g1)  # the norm before the MLP
        m = gelu_mul(gate_up(h, wg))[:, :H]  # stands in for down_proj
        h, s = gemma_add_norm(m, s, g2)  # layer 1's input norm
        a = qkv(h, wq)[:, :H]
        return gemma_add_norm(a, s, g3)[0]  # the final norm
    args = [x_().half(), w_(H, dtype=F16), qkv.arg, w_(H, dtype=F16), gate_up.arg, w_(H, dtype=F16),
            w_(H, dtype=F16)]
    kinds = table(("gemma_rmsnorm_linear", (F16, (H, QKV), EPS)), ("gemma_fused_add_rmsnorm_linear", (F16, (H, QKV), EPS)),
                  ("gemma_rmsnorm_geglu", (F16, (H, INTER), EPS)), ("gemma_fused_add_rms_norm", (F16, H, EPS)))
    done, left = rewrite(layers, args, kinds)
    assert done == {"gemma_rmsnorm_linear": 1, "gemma_fused_add_rmsnorm_linear": 1, "gemma_rmsnorm_geglu": 1,
                    "gemma_fused_add_rms_norm": 1}
    assert left == {"gemma_rmsnorm_linear", "gemma_fused_add_rmsnorm_linear", "gemma_rmsnorm_geglu",
                    "gemma_fused_add_rms_norm"}
    # a plain region's kernel at the same keys takes no Gemma norm; without the final norm's own
    # kernel the op form put in as the regions' marker goes back to vLLM's
    plain = table(("rmsnorm_linear", (F16, (H, QKV), EPS)), ("fused_add_rmsnorm_linear", (F16, (H, QKV), EPS)),
                  ("rmsnorm_geglu", (F16, (H, INTER), EPS)))
    assert rewrite(layers, args, plain) == ({}, set())
    done, left = rewrite(layers, args, table(("gemma_rmsnorm_linear", (F16, (H, QKV), EPS))))
    assert done == {"gemma_rmsnorm_linear": 2} and left == {"gemma_rmsnorm_linear"}  # the residual add beside it


def test_kernels_of_two_dtypes_at_one_size_leave_the_pass_working():
    """A registry with kernels for float32 and float16 at the same sizes (two models, or one model
    warmed for two dtypes): forms that trace to one graph whatever the dtype (the prism op a revert
    starts from, vLLM's IR op) are registered once, and the pass serves each dtype's regions."""
    gate_up = Proj("onednn", 2 * INTER)

    def fn(x, r, g, w):
        h, _ = gemma_add_norm(x, r, g)
        return gelu_mul(gate_up(h, w))
    both = table(("rmsnorm_geglu", (F32, (H, INTER), EPS)), ("gemma_rmsnorm_geglu", (F16, (H, INTER), EPS)),
                 ("rms_norm", (F32, H, EPS)), ("rms_norm", (F16, H, EPS)))
    done, _ = rewrite(fn, [x_(), x_(), w_(H), gate_up.arg], both)
    assert done == {"rmsnorm_geglu": 1}
    half = Proj("onednn" if onednn_handles(F16) else "mm", 2 * INTER, F16)  # what vLLM runs on this CPU

    def fn16(x, r, g, w):
        h, _ = gemma_add_norm(x, r, g)
        return gelu_mul(half(h, w))
    done, _ = rewrite(fn16, [x_().half(), x_().half(), w_(H, dtype=F16), half.arg], both)
    assert done == {"gemma_rmsnorm_geglu": 1}
