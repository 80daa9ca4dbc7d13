"""The prism torch custom ops (`prism::rms_norm`, `prism::fused_add_rms_norm`,
`prism::silu_and_mul`, Gemma's `prism::gemma_rms_norm`, `prism::gemma_fused_add_rms_norm` and
`prism::gelu_tanh_and_mul`, and the whole-region `prism::swiglu`, `prism::geglu`, `prism::rmsnorm_geglu`,
`prism::rmsnorm_linear`, `prism::fused_add_rmsnorm_linear`, their `_bias` forms (a projection that
adds a bias, as Qwen2's qkv), their `gemma_` forms and `prism::gemma_rmsnorm_geglu` (on Gemma's
stored norm weight w, scaling by 1 + w) and `prism::rmsnorm_swiglu`): opaque to
torch.compile, with fake impls, dispatching by num_tokens.

Each op picks the registry kernel for (dtype, dim, eps, rows) from the table installed at
startup; a miss (no kernel for that shape, dtype or device, or a kernel that failed) runs
vLLM's own path (`FALLBACKS`, set by the vLLM hooks; the torch references below otherwise).
The ops holding a projection take its weight either as the plain [out, in] tensor or, where
vLLM's CPU build packed it, as what the graph holds instead: vLLM's 0-d oneDNN handle tensor plus
`out_features`, or the weight packed for its AMX GEMM (`_C.weight_packed_linear`, small bf16/fp16
weights on AMX machines). The kernel then runs on the plain weight recorded when vLLM packed it
(`PACKED`, `PACKED_AMX`), and a miss runs vLLM's own path, its packed GEMM included.

Calls are counted per op (`COUNTS`: kernel launches, `MISSES`: fallbacks) and written as JSON
to $PRISM_SERVE_COUNTERS (at exit, and every half second while serving), so tests can prove
the kernels ran.
"""


import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from prism_serve.patch.table import Table
from prism_serve.region_table import KINDS

log = logging.getLogger("vllm.prism_serve.ops")  # among vLLM's own lines, like the plugin's (see plugin.py)
COUNTERS_ENV = "PRISM_SERVE_COUNTERS"
OP_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "swiglu", "rmsnorm_linear", "fused_add_rmsnorm_linear",
            "rmsnorm_swiglu", "gemma_rms_norm", "gemma_fused_add_rms_norm", "gelu_tanh_and_mul", "geglu",
            "rmsnorm_linear_bias", "fused_add_rmsnorm_linear_bias", "rmsnorm_geglu", "gemma_rmsnorm_linear",
            "gemma_fused_add_rmsnorm_linear", "gemma_rmsnorm_geglu")


class _State:
    def __init__(self) -> None:
        self.table: Table | None = None
        self.failed: set[int] = set()  # kernel ids that raised at run time: never launched again


STATE = _State()
COUNTS: dict[str, int] = dict.fromkeys(OP_NAMES, 0)
MISSES: dict[str, int] = dict.fromkeys(OP_NAMES, 0)


# --- vLLM's semantics in torch: the fallback when no vLLM hook supplied its own path ---------

def ref_rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    orig = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (xf.to(weight.dtype) * weight).to(orig)


def ref_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    orig = x.dtype
    s = x.to(torch.float32) + residual.to(torch.float32)
    r = s.to(orig)
    s = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (s.to(weight.dtype) * weight).to(orig), r


def ref_silu_and_mul(x: Tensor) -> Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def ref_swiglu(x: Tensor, w_gate_up: Tensor, site: int) -> Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) with W_gate_up = [W_gate; W_up] (vLLM's merged layout)."""
    return ref_silu_and_mul(torch.nn.functional.linear(x, w_gate_up))


def ref_rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float, site: int) -> Tensor:
    """rms_norm(x) * g @ W^T: a decoder's input norm feeding its qkv projection."""
    return torch.nn.functional.linear(ref_rms_norm(x, norm_weight, epsilon), weight)


def ref_fused_add_rmsnorm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float,
                                 site: int) -> tuple[Tensor, Tensor]:
    """(fused_add_rms_norm(x, residual) @ W^T, x + residual): a decoder's input side."""
    y, r = ref_fused_add_rms_norm(x, residual, norm_weight, epsilon)
    return torch.nn.functional.linear(y, weight), r


def ref_rmsnorm_linear_bias(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor, epsilon: float,
                            site: int) -> Tensor:
    """rms_norm(x) * g @ W^T + b: the input norm feeding a qkv projection with a bias (Qwen2)."""
    return torch.nn.functional.linear(ref_rms_norm(x, norm_weight, epsilon), weight, bias)


def ref_fused_add_rmsnorm_linear_bias(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor,
                                      epsilon: float, site: int) -> tuple[Tensor, Tensor]:
    y, r = ref_fused_add_rms_norm(x, residual, norm_weight, epsilon)
    return torch.nn.functional.linear(y, weight, bias), r


def ref_rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float, site: int) -> Tensor:
    """SiLU*mul of rms_norm(x) * g @ [W_gate; W_up]^T: a decoder's post-attention norm and MLP input."""
    return ref_swiglu(ref_rms_norm(x, norm_weight, epsilon), w_gate_up, site)


def ref_gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """vLLM's GeluAndMul(approximate="tanh").forward_native (its path on the CPU build)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def ref_gemma_rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """vLLM's GemmaRMSNorm: its RMSNorm op (the current fallback) on the float32 weight + 1."""
    return FALLBACKS["rms_norm"](x, weight.float() + 1.0, epsilon)


def ref_gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    return FALLBACKS["fused_add_rms_norm"](x, residual, weight.float() + 1.0, epsilon)


FALLBACKS: dict[str, Callable] = {"rms_norm": ref_rms_norm, "fused_add_rms_norm": ref_fused_add_rms_norm,
                                  "silu_and_mul": ref_silu_and_mul, "swiglu": ref_swiglu,
                                  "rmsnorm_linear": ref_rmsnorm_linear,
                                  "fused_add_rmsnorm_linear": ref_fused_add_rmsnorm_linear,
                                  "rmsnorm_linear_bias": ref_rmsnorm_linear_bias,
                                  "fused_add_rmsnorm_linear_bias": ref_fused_add_rmsnorm_linear_bias,
                                  "rmsnorm_swiglu": ref_rmsnorm_swiglu, "gemma_rms_norm": ref_gemma_rms_norm,
                                  "gemma_fused_add_rms_norm": ref_gemma_fused_add_rms_norm,
                                  "gelu_tanh_and_mul": ref_gelu_tanh_and_mul,
                                  "geglu": lambda x, w_gate_up, site: ref_gelu_tanh_and_mul(
                                      torch.nn.functional.linear(x, w_gate_up)),
                                  "rmsnorm_geglu": lambda x, norm_weight, w_gate_up, epsilon, site:
                                      ref_gelu_tanh_and_mul(torch.nn.functional.linear(
                                          ref_rms_norm(x, norm_weight, epsilon), w_gate_up)),
                                  "gemma_rmsnorm_linear": lambda x, norm_weight, weight, epsilon, site:
                                      torch.nn.functional.linear(ref_gemma_rms_norm(x, norm_weight, epsilon), weight),
                                  "gemma_fused_add_rmsnorm_linear": lambda x, residual, norm_weight, weight, epsilon,
                                  site: _project(ref_gemma_fused_add_rms_norm(x, residual, norm_weight, epsilon),
                                                 weight),
                                  "gemma_rmsnorm_geglu": lambda x, norm_weight, w_gate_up, epsilon, site:
                                      ref_gelu_tanh_and_mul(torch.nn.functional.linear(
                                          ref_gemma_rms_norm(x, norm_weight, epsilon), w_gate_up))}


def _project(normed: tuple[Tensor, Tensor], weight: Tensor) -> tuple[Tensor, Tensor]:
    y, r = normed
    return torch.nn.functional.linear(y, weight), r


# --- a projection's weight: the plain tensor, or what vLLM's CPU build packed it into ---------

# oneDNN handle (the pointer value vLLM keeps in its handler tensor) -> the plain [out, in] weight it
# was packed from, recorded by the plugin while vLLM loads the weights (`hooks._install_packed`)
PACKED: dict[int, Tensor] = {}
# data pointer of every weight vLLM packed for its AMX GEMM (`_C.weight_packed_linear`) while the
# plugin was installed -> the plain [out, in] weight, or None where no region kernel serves its shape.
# A packed weight has the plain one's dtype and shape, so only this tells the two apart.
PACKED_AMX: dict[int, Tensor | None] = {}


def is_handle(weight: Tensor) -> bool:
    """vLLM's oneDNN handler tensor: a 0-d int64 tensor holding the packed GEMM's pointer."""
    return weight.dim() == 0 and weight.dtype == torch.int64


def _is_amx_packed(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.data_ptr() in PACKED_AMX


def plain_weight(weight: Tensor) -> Tensor | None:
    """The [out, in] weight a kernel multiplies with, or None where none was recorded."""
    if is_handle(weight):
        return PACKED.get(int(weight.item()))
    return PACKED_AMX[weight.data_ptr()] if _is_amx_packed(weight) else weight


def _out_features(weight: Tensor, out_features: int) -> int:
    return out_features if is_handle(weight) else weight.shape[0]


def vllm_linear(x: Tensor, weight: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """vLLM's projection: its oneDNN GEMM on the handle, its AMX GEMM on a weight it packed for
    that, or torch's linear."""
    if not is_handle(weight) and not _is_amx_packed(weight):
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    if is_handle(weight):
        torch.ops._C.onednn_mm(out, x.reshape(-1, x.shape[-1]), bias, weight)
    else:
        torch.ops._C.weight_packed_linear(out.reshape(-1, out_features), x.reshape(-1, x.shape[-1]), weight, bias, True)
    return out


def _vllm_region(kind: str, site: int, weight: Tensor, out_features: int, *args, bias: Tensor | None = None):
    """vLLM's own path for a region kernel miss: the class-level hook's (site >= 0, eager mode), or
    vLLM's ops in order (regions the fusion pass made): its norm, its projection (with its bias,
    for a `_bias` kind), its activation. `args` are the op's own, the bias left out."""
    if site >= 0:
        return FALLBACKS[kind](*args) if bias is None else FALLBACKS[kind](*args[:-2], bias, *args[-2:])
    k = KINDS[kind]
    if k.form.norm is None:  # projection + activation
        return FALLBACKS[k.act_op.name](vllm_linear(args[0], weight, out_features))
    if k.form.residual:
        x, residual, norm_weight, _, eps, _ = args
        y, r = FALLBACKS[k.norm_op.name](x, residual, norm_weight, eps)
        return vllm_linear(y, weight, out_features, bias), r
    x, norm_weight, _, eps, _ = args
    y = vllm_linear(FALLBACKS[k.norm_op.name](x, norm_weight, eps), weight, out_features, bias)
    return FALLBACKS[k.act_op.name](y) if k.form.act else y


# --- dispatch --------------------------------------------------------------------------

def pick(op: str, x: Tensor, dim: int, eps: float | None):
    """The launcher for this call, counted, or None: prism's whole per-call dispatch cost
    (table and bucket lookup, bookkeeping) before the kernel launch."""
    table = STATE.table
    if table is None or x.device.type != table.device:
        return None
    buckets = table.entry(op, x.dtype, dim, eps)
    if buckets is None:
        return None
    launcher = buckets.pick(x.numel() // x.shape[-1])  # rows: tokens (x heads for q/k norm)
    if launcher is None or launcher.kernel_id in STATE.failed:
        return None
    COUNTS[op] += 1
    return launcher


def _failed(op: str, launcher, exc: BaseException) -> None:
    """A kernel raised at run time: vLLM's own path serves its calls from now on."""
    COUNTS[op] -= 1
    STATE.failed.add(launcher.kernel_id)
    log.warning("prism-serve: kernel %d for %s failed (%s: %s); vLLM's own path serves it from now on",
                launcher.kernel_id, op, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _rows(x: Tensor, dim: int) -> Tensor:
    return x if x.dim() == 2 else x.reshape(-1, dim)


def rms_norm_impl(x: Tensor, weight: Tensor, epsilon: float, op: str = "rms_norm") -> Tensor:
    dim = x.shape[-1]
    launcher = pick(op, x, dim, epsilon)
    if launcher is not None:
        try:
            (y,) = launcher.run(_rows(x, dim), weight)
            return y if x.dim() == 2 else y.view(x.shape)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    MISSES[op] += 1
    return FALLBACKS[op](x, weight, epsilon)


def fused_add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float,
                            op: str = "fused_add_rms_norm") -> tuple[Tensor, Tensor]:
    dim = x.shape[-1]
    same = residual.shape == x.shape and residual.dtype == x.dtype
    launcher = pick(op, x, dim, epsilon) if same else None
    if launcher is not None:
        try:
            y, r = launcher.run(_rows(x, dim), _rows(residual, dim), weight)
            return (y, r) if x.dim() == 2 else (y.view(x.shape), r.view(x.shape))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    MISSES[op] += 1
    return FALLBACKS[op](x, residual, weight, epsilon)


def silu_and_mul_impl(x: Tensor, op: str = "silu_and_mul") -> Tensor:
    d = x.shape[-1] // 2
    launcher = pick(op, x, d, None)
    if launcher is not None:
        try:
            x2 = _rows(x, 2 * d)
            (y,) = launcher.run(x2[:, :d], x2[:, d:])
            return y if x.dim() == 2 else y.view(*x.shape[:-1], d)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    MISSES[op] += 1
    return FALLBACKS[op](x)


def gemma_rms_norm_impl(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return rms_norm_impl(x, weight, epsilon, "gemma_rms_norm")


def gemma_fused_add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_impl(x, residual, weight, epsilon, "gemma_fused_add_rms_norm")


def gelu_tanh_and_mul_impl(x: Tensor) -> Tensor:
    return silu_and_mul_impl(x, "gelu_tanh_and_mul")


def geglu_impl(x: Tensor, w_gate_up: Tensor, site: int, out_features: int = -1) -> Tensor:
    return swiglu_impl(x, w_gate_up, site, out_features, "geglu")


def swiglu_impl(x: Tensor, w_gate_up: Tensor, site: int, out_features: int = -1, op: str = "swiglu") -> Tensor:
    inter = _out_features(w_gate_up, out_features) // 2
    launcher = pick(op, x, (x.shape[-1], inter), None)
    w = plain_weight(w_gate_up) if launcher is not None else None
    if w is not None:
        try:
            (y,) = launcher.run(_rows(x, x.shape[-1]), w[:inter], w[inter:])
            return y if x.dim() == 2 else y.view(*x.shape[:-1], inter)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    elif launcher is not None:
        COUNTS[op] -= 1  # no plain weight was recorded for this handle
    MISSES[op] += 1
    return _vllm_region(op, site, w_gate_up, 2 * inter, x, w_gate_up, site)


def rmsnorm_linear_impl(x: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float, site: int,
                        out_features: int = -1, bias: Tensor | None = None, op: str | None = None) -> Tensor:
    """`rmsnorm_linear`, with `bias` the `rmsnorm_linear_bias` kernel (the bias its last input), or
    (`op`) `gemma_rmsnorm_linear`: the same inputs, the norm scaling by 1 + norm_weight."""
    op = op or ("rmsnorm_linear" if bias is None else "rmsnorm_linear_bias")
    hidden, out = x.shape[-1], _out_features(weight, out_features)
    launcher = pick(op, x, (hidden, out), epsilon)
    w = plain_weight(weight) if launcher is not None else None
    if w is not None:
        try:
            (y,) = launcher.run(_rows(x, hidden), norm_weight, w, *(() if bias is None else (bias,)))
            return y if x.dim() == 2 else y.view(*x.shape[:-1], out)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    elif launcher is not None:
        COUNTS[op] -= 1
    MISSES[op] += 1
    return _vllm_region(op, site, weight, out, x, norm_weight, weight, epsilon, site, bias=bias)


def fused_add_rmsnorm_linear_impl(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float,
                                  site: int, out_features: int = -1, bias: Tensor | None = None,
                                  op: str | None = None) -> tuple[Tensor, Tensor]:
    """`fused_add_rmsnorm_linear`, with `bias` its `_bias` kernel (the bias its last input), or (`op`)
    `gemma_fused_add_rmsnorm_linear`."""
    op = op or ("fused_add_rmsnorm_linear" if bias is None else "fused_add_rmsnorm_linear_bias")
    hidden, out = x.shape[-1], _out_features(weight, out_features)
    same = residual.shape == x.shape and residual.dtype == x.dtype
    launcher = pick(op, x, (hidden, out), epsilon) if same else None
    w = plain_weight(weight) if launcher is not None else None
    if w is not None:
        try:
            y, r = launcher.run(_rows(x, hidden), _rows(residual, hidden), norm_weight, w,
                                *(() if bias is None else (bias,)))
            return (y, r) if x.dim() == 2 else (y.view(*x.shape[:-1], out), r.view(x.shape))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    elif launcher is not None:
        COUNTS[op] -= 1
    MISSES[op] += 1
    return _vllm_region(op, site, weight, out, x, residual, norm_weight, weight, epsilon, site, bias=bias)


def rmsnorm_swiglu_impl(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float, site: int,
                        out_features: int = -1, op: str = "rmsnorm_swiglu") -> Tensor:
    """`rmsnorm_swiglu`, or (`op`) `rmsnorm_geglu` / `gemma_rmsnorm_geglu`: the same inputs, another
    activation (and norm)."""
    inter = _out_features(w_gate_up, out_features) // 2
    launcher = pick(op, x, (x.shape[-1], inter), epsilon)
    w = plain_weight(w_gate_up) if launcher is not None else None
    if w is not None:
        try:
            (y,) = launcher.run(_rows(x, x.shape[-1]), norm_weight, w[:inter], w[inter:])
            return y if x.dim() == 2 else y.view(*x.shape[:-1], inter)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
            _failed(op, launcher, exc)
    elif launcher is not None:
        COUNTS[op] -= 1
    MISSES[op] += 1
    return _vllm_region(op, site, w_gate_up, 2 * inter, x, norm_weight, w_gate_up, epsilon, site)


# --- torch custom ops: opaque to Dynamo, with fake impls for torch.compile -------------------

def _define() -> dict[str, object]:
    defined = {}

    @torch.library.custom_op("prism::rms_norm", mutates_args=())
    def rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
        return rms_norm_impl(x, weight, epsilon)

    @rms_norm.register_fake
    def _(x, weight, epsilon):
        return torch.empty_like(x)

    @torch.library.custom_op("prism::fused_add_rms_norm", mutates_args=())
    def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm_impl(x, residual, weight, epsilon)

    @fused_add_rms_norm.register_fake
    def _(x, residual, weight, epsilon):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("prism::silu_and_mul", mutates_args=())
    def silu_and_mul(x: Tensor) -> Tensor:
        return silu_and_mul_impl(x)

    @silu_and_mul.register_fake
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    # the projection's weight: a plain [out, in] tensor, or vLLM's oneDNN handle and `out_features`
    @torch.library.custom_op("prism::swiglu", mutates_args=())
    def swiglu(x: Tensor, w_gate_up: Tensor, site: int, out_features: int = -1) -> Tensor:
        return swiglu_impl(x, w_gate_up, site, out_features)

    @swiglu.register_fake
    def _(x, w_gate_up, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(w_gate_up, out_features) // 2))

    @torch.library.custom_op("prism::rmsnorm_linear", mutates_args=())
    def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float, site: int,
                       out_features: int = -1) -> Tensor:
        return rmsnorm_linear_impl(x, norm_weight, weight, epsilon, site, out_features)

    @rmsnorm_linear.register_fake
    def _(x, norm_weight, weight, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features)))

    @torch.library.custom_op("prism::fused_add_rmsnorm_linear", mutates_args=())
    def fused_add_rmsnorm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float,
                                 site: int, out_features: int = -1) -> tuple[Tensor, Tensor]:
        return fused_add_rmsnorm_linear_impl(x, residual, norm_weight, weight, epsilon, site, out_features)

    @fused_add_rmsnorm_linear.register_fake
    def _(x, residual, norm_weight, weight, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features))), torch.empty_like(x)

    @torch.library.custom_op("prism::rmsnorm_linear_bias", mutates_args=())
    def rmsnorm_linear_bias(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor, epsilon: float, site: int,
                            out_features: int = -1) -> Tensor:
        return rmsnorm_linear_impl(x, norm_weight, weight, epsilon, site, out_features, bias)

    @rmsnorm_linear_bias.register_fake
    def _(x, norm_weight, weight, bias, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features)))

    @torch.library.custom_op("prism::fused_add_rmsnorm_linear_bias", mutates_args=())
    def fused_add_rmsnorm_linear_bias(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor,
                                      epsilon: float, site: int, out_features: int = -1) -> tuple[Tensor, Tensor]:
        return fused_add_rmsnorm_linear_impl(x, residual, norm_weight, weight, epsilon, site, out_features, bias)

    @fused_add_rmsnorm_linear_bias.register_fake
    def _(x, residual, norm_weight, weight, bias, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features))), torch.empty_like(x)

    defined.update(rmsnorm_linear_bias=rmsnorm_linear_bias, fused_add_rmsnorm_linear_bias=fused_add_rmsnorm_linear_bias)

    @torch.library.custom_op("prism::rmsnorm_swiglu", mutates_args=())
    def rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float, site: int,
                       out_features: int = -1) -> Tensor:
        return rmsnorm_swiglu_impl(x, norm_weight, w_gate_up, epsilon, site, out_features)

    @rmsnorm_swiglu.register_fake
    def _(x, norm_weight, w_gate_up, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(w_gate_up, out_features) // 2))

    # Gemma: its norms take the stored weight w (the kernel scales by 1 + w), GeGLU as SwiGLU
    @torch.library.custom_op("prism::gemma_rms_norm", mutates_args=())
    def gemma_rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
        return gemma_rms_norm_impl(x, weight, epsilon)

    @gemma_rms_norm.register_fake
    def _(x, weight, epsilon):
        return torch.empty_like(x)

    @torch.library.custom_op("prism::gemma_fused_add_rms_norm", mutates_args=())
    def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                                 epsilon: float) -> tuple[Tensor, Tensor]:
        return gemma_fused_add_rms_norm_impl(x, residual, weight, epsilon)

    @gemma_fused_add_rms_norm.register_fake
    def _(x, residual, weight, epsilon):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("prism::gelu_tanh_and_mul", mutates_args=())
    def gelu_tanh_and_mul(x: Tensor) -> Tensor:
        return gelu_tanh_and_mul_impl(x)

    @gelu_tanh_and_mul.register_fake
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.custom_op("prism::geglu", mutates_args=())
    def geglu(x: Tensor, w_gate_up: Tensor, site: int, out_features: int = -1) -> Tensor:
        return geglu_impl(x, w_gate_up, site, out_features)

    @geglu.register_fake
    def _(x, w_gate_up, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(w_gate_up, out_features) // 2))

    @torch.library.custom_op("prism::rmsnorm_geglu", mutates_args=())
    def rmsnorm_geglu(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float, site: int,
                      out_features: int = -1) -> Tensor:
        return rmsnorm_swiglu_impl(x, norm_weight, w_gate_up, epsilon, site, out_features, "rmsnorm_geglu")

    @rmsnorm_geglu.register_fake
    def _(x, norm_weight, w_gate_up, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(w_gate_up, out_features) // 2))

    defined.update(rmsnorm_geglu=rmsnorm_geglu)

    # Gemma's norm + projection regions on the stored norm weight (bf16, fp16: vLLM's w + 1 is float32)
    @torch.library.custom_op("prism::gemma_rmsnorm_linear", mutates_args=())
    def gemma_rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float, site: int,
                             out_features: int = -1) -> Tensor:
        return rmsnorm_linear_impl(x, norm_weight, weight, epsilon, site, out_features, op="gemma_rmsnorm_linear")

    @gemma_rmsnorm_linear.register_fake
    def _(x, norm_weight, weight, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features)))

    @torch.library.custom_op("prism::gemma_fused_add_rmsnorm_linear", mutates_args=())
    def gemma_fused_add_rmsnorm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor,
                                       epsilon: float, site: int, out_features: int = -1) -> tuple[Tensor, Tensor]:
        return fused_add_rmsnorm_linear_impl(x, residual, norm_weight, weight, epsilon, site, out_features,
                                             op="gemma_fused_add_rmsnorm_linear")

    @gemma_fused_add_rmsnorm_linear.register_fake
    def _(x, residual, norm_weight, weight, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(weight, out_features))), torch.empty_like(x)

    @torch.library.custom_op("prism::gemma_rmsnorm_geglu", mutates_args=())
    def gemma_rmsnorm_geglu(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float, site: int,
                            out_features: int = -1) -> Tensor:
        return rmsnorm_swiglu_impl(x, norm_weight, w_gate_up, epsilon, site, out_features, "gemma_rmsnorm_geglu")

    @gemma_rmsnorm_geglu.register_fake
    def _(x, norm_weight, w_gate_up, epsilon, site, out_features=-1):
        return x.new_empty((*x.shape[:-1], _out_features(w_gate_up, out_features) // 2))

    defined.update(gemma_rmsnorm_linear=gemma_rmsnorm_linear, gemma_fused_add_rmsnorm_linear=gemma_fused_add_rmsnorm_linear,
                   gemma_rmsnorm_geglu=gemma_rmsnorm_geglu)
    defined.update(gemma_rms_norm=gemma_rms_norm, gemma_fused_add_rms_norm=gemma_fused_add_rms_norm,
                   gelu_tanh_and_mul=gelu_tanh_and_mul, geglu=geglu)
    defined.update(fused_add_rmsnorm_linear=fused_add_rmsnorm_linear, rmsnorm_swiglu=rmsnorm_swiglu)
    defined.update(rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm, silu_and_mul=silu_and_mul,
                   swiglu=swiglu, rmsnorm_linear=rmsnorm_linear)
    return defined


_DEFINED: dict[str, object] = {}


def define_ops() -> dict[str, object]:
    """Register the prism ops with torch once per process (idempotent)."""
    if not _DEFINED:
        if hasattr(torch.ops.prism, "rms_norm"):  # defined by an earlier import of another copy
            _DEFINED.update({n: getattr(torch.ops.prism, n) for n in OP_NAMES})
        else:
            _DEFINED.update(_define())
    return _DEFINED


# --- counters --------------------------------------------------------------------------

def counters() -> dict[str, dict[str, int]]:
    return {"kernel": dict(COUNTS), "fallback": dict(MISSES), "failed_kernels": sorted(STATE.failed)}


def _write_counters() -> None:
    path = os.environ.get(COUNTERS_ENV)
    if not path or not (any(COUNTS.values()) or any(MISSES.values())):
        return  # a process that ran no prism op (e.g. vLLM's API server) leaves the file alone
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(counters() | {"pid": os.getpid()}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("prism-serve: cannot write counters to %s: %s", path, exc)


def _flush_periodically(period_s: float) -> None:
    """vLLM's workers may end without running atexit: keep the file current while serving."""
    last = None
    while True:
        time.sleep(period_s)
        now = (tuple(COUNTS.values()), tuple(MISSES.values()))
        if now != last:
            _write_counters()
            last = now


_ATEXIT = []


def install_counters_at_exit(period_s: float = 0.5) -> None:
    """Write the counters to $PRISM_SERVE_COUNTERS at exit and, while serving, every `period_s`."""
    if os.getpid() in _ATEXIT or not os.environ.get(COUNTERS_ENV):
        return  # a forked child inherits the list but not the thread: it starts its own
    if not _ATEXIT:
        atexit.register(_write_counters)
    threading.Thread(target=_flush_periodically, args=(period_s,), name="prism-counters", daemon=True).start()
    _ATEXIT.append(os.getpid())
