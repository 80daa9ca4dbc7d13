"""The `prism::<kind>` torch custom ops, one per region kind of the region table, and their one
generic dispatch: opaque to torch.compile, with fake impls, dispatching by num_tokens.

Everything per kind is derived from its `RegionKind`: the op's schema from `args` and `outputs`,
its fake from its form (what it keeps of x's shape), the kernel's inputs in the Program's order, and
vLLM's path on a miss. As vLLM registers its ops from one function and its fake
(`direct_register_custom_op`), the schemas are defined once per process (`define`) and the
kernels are registered per `Runtime` (`open_runtime`): a `torch.library.Library` fragment whose
impls close over that runtime, dropped when it closes. The op objects (`torch.ops.prism.<kind>`)
stay the same across runtimes, so graphs compiled against them (Inductor, the fusion pass's
patterns) stay valid; the impl is registered for CompositeExplicitAutograd, as torch's own
`custom_op` does, and the fake for Meta, so Dynamo traces the op as opaque.

Each call picks the registry kernel for (dtype, dim, eps, rows) from the runtime's table; a miss
(no kernel for that shape, dtype or device, or a kernel that failed) runs vLLM's own path (the
runtime's `fallbacks`, set by the vLLM hooks; the torch references below otherwise). The ops
holding a projection take its weight either as the plain [out, in] tensor or, where vLLM's CPU
build packed it, as what the graph holds instead: vLLM's 0-d oneDNN handle tensor plus
`out_features`, or the weight packed for its AMX GEMM. The kernel then runs on the plain weight
recorded when vLLM packed it, and a miss runs vLLM's own path, its packed GEMM included.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
from torch import Tensor

from prism_serve.optimize.ir.ops import Op
from prism_serve.patch.explain import mismatch
from prism_serve.patch.runtime import Runtime, current, log, out_features
from prism_serve.patch.table import Table
from prism_serve.region_table import KINDS, Form, RegionKind, kind_of

# the schema type of each argument name a RegionKind's `args` uses
ARG_TYPES = MappingProxyType({"x": "Tensor", "residual": "Tensor", "weight": "Tensor", "norm_weight": "Tensor",
                              "w_gate_up": "Tensor", "bias": "Tensor", "epsilon": "float", "site": "int",
                              "out_features": "int", "positions": "Tensor", "q": "Tensor", "k": "Tensor",
                              "q_weight": "Tensor", "k_weight": "Tensor", "cos_sin_cache": "Tensor",
                              "head_size": "int", "is_neox": "bool", "topk_weights": "Tensor", "topk_ids": "Tensor",
                              "w13": "Tensor", "w2": "Tensor"})
DEFAULTS = MappingProxyType({"out_features": -1})  # where the hooks' calls leave an argument out


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


def ref_gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """vLLM's GeluAndMul(approximate="tanh").forward_native (its path on the CPU build)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, head_size: int, is_neox: bool) -> Tensor:
    """One of q, k rotated as vLLM's `ApplyRotaryEmb.forward_static` does it, in x's shape."""
    shape, rotary_dim = x.shape, 2 * cos.shape[-1]
    x = x.reshape(cos.shape[0], -1, head_size)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = rot.chunk(2, dim=-1) if is_neox else (rot[..., ::2], rot[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1).reshape(shape)


def ref_rotary(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, head_size: int,
               is_neox: bool) -> tuple[Tensor, Tensor]:
    """vLLM's RotaryEmbedding.forward_static (its path with custom ops off), on new tensors: the cos/sin
    rows of the cache gathered by position, the first rotary_dim (the cache's width) of each head rotated."""
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    return _rotate(q, cos, sin, head_size, is_neox), _rotate(k, cos, sin, head_size, is_neox)


def ref_moe_experts(act: str):
    """vLLM's routed experts in torch, for activation `act` (one of ACT_REFS): per choice j of each
    token, expert topk_ids[t, j]'s act(x W1^T) * (x W3^T) W2^T, summed weighted by topk_weights[t, j]
    (x [T, H], the routing [T, k], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I])."""
    gated = ACT_REFS[act]

    def ref(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        xf = x.float()
        out = torch.zeros_like(xf)
        for j in range(topk_ids.shape[1]):
            e = topk_ids[:, j].long()
            h = gated(torch.einsum("th,tnh->tn", xf, w13[e].float()))
            out += topk_weights[:, j:j + 1].float() * torch.einsum("ti,thi->th", h, w2[e].float())
        return out.to(x.dtype)
    return ref


# vLLM's RMSNorm ops by whether they add the residual, and its activations by gate function
NORM_REFS = MappingProxyType({False: ref_rms_norm, True: ref_fused_add_rms_norm})
ROTARY = kind_of(Form(rotary=True))  # vLLM's rotary op, the last part of every rotary kind
ACT_REFS = MappingProxyType({Op.SILU: ref_silu_and_mul, Op.GELU_TANH: ref_gelu_tanh_and_mul})


def _gemma(rt: Runtime, plain: RegionKind, x: Tensor, *rest):
    """vLLM's GemmaRMSNorm: its RMSNorm op (the current fallback of `plain`) on the float32 weight + 1."""
    *inputs, weight, epsilon = rest
    return rt.fallbacks[plain.name](x, *inputs, weight.float() + 1.0, epsilon)


def references(rt: Runtime) -> dict:
    """vLLM's path per op-level kind in torch, the fallbacks of a runtime no vLLM hook changed: its
    RMSNorm ops, its activations; Gemma's norm is vLLM's RMSNorm op (whatever `rt` runs for it) on
    the float32 weight + 1. A region holding a projection falls back through these (`vllm_path`)."""
    out = {ROTARY.name: ref_rotary}
    for kind in KINDS.values():
        f = kind.form
        if f.experts:
            out[kind.name] = ref_moe_experts(f.act)
        if f.projection or f.rotary or f.experts:
            continue
        if f.act:
            out[kind.name] = ACT_REFS[f.act]
        elif f.norm == "rms":
            out[kind.name] = NORM_REFS[f.residual]
        else:
            out[kind.name] = functools.partial(_gemma, rt, kind_of(Form("rms", f.residual)))
    return out


def vllm_path(rt: Runtime, kind: RegionKind, a: dict):
    """vLLM's own path for a miss, on the op's arguments `a` (by name): the op-level kind's fallback;
    for a region, the eager hook's (a patched model site, `site` >= 0), or vLLM's ops in order (regions
    the fusion pass made): its norm, its projection (with its bias), its activation."""
    f = kind.form
    if f.rotary:
        return _vllm_rotary(rt, kind, a)
    if not f.projection:  # an op-level kind, rotary's own op, or the experts (on the weights as vLLM holds them)
        return rt.fallbacks[kind.name](*(a[n] for n in kind.args))
    if a["site"] >= 0 and kind.name in rt.fallbacks:
        return rt.fallbacks[kind.name](*(a[n] for n in kind.args if n != "out_features"))
    weight = a["w_gate_up" if f.act else "weight"]
    y, r = a["x"], None
    if f.norm:
        normed = rt.fallbacks[kind.norm_op.name](y, *((a["residual"],) if f.residual else ()), a["norm_weight"],
                                                 a["epsilon"])
        y, r = normed if f.residual else (normed, None)
    y = rt.vllm_linear(y, weight, out_features(weight, a["out_features"]), a.get("bias"))
    if f.act:
        y = rt.fallbacks[kind.act_op.name](y)
    return (y, r) if f.residual else y


def _vllm_rotary(rt: Runtime, kind: RegionKind, a: dict) -> tuple[Tensor, Tensor]:
    """vLLM's rotary (its kernel on copies of q and k, or its torch body), after its RMSNorm of q's and
    k's heads (QK-norm) where the kind has one: new tensors, the op's inputs untouched."""
    q, k, d = a["q"], a["k"], a["head_size"]
    if kind.form.norm:
        norm = rt.fallbacks[kind.norm_op.name]
        q = norm(q.reshape(*q.shape[:-1], -1, d), a["q_weight"], a["epsilon"]).reshape(q.shape)
        k = norm(k.reshape(*k.shape[:-1], -1, d), a["k_weight"], a["epsilon"]).reshape(k.shape)
    return rt.fallbacks[ROTARY.name](a["positions"], q, k, a["cos_sin_cache"], d, a["is_neox"])


def reference(kind: str):
    """The torch reference of `kind`'s op, with the op's arguments (vLLM's path with no vLLM hook)."""
    rt = Runtime()
    rt.fallbacks.update(references(rt))
    k = KINDS[kind]

    def ref(*args):
        return vllm_path(rt, k, _named(k, args, {}))
    return ref


# --- dispatch --------------------------------------------------------------------------

def _rows(x: Tensor, dim: int) -> Tensor:
    return x if x.dim() == 2 else x.reshape(-1, dim)


def _named(kind: RegionKind, args: tuple, kwargs: dict) -> dict:
    return {n: DEFAULTS[n] for n in kind.args if n in DEFAULTS} | dict(zip(kind.args, args)) | kwargs


def run(rt: Runtime, kind: RegionKind, *args, **kwargs):
    """The one dispatch of every prism op: the kernel for this call where the table has one (its
    inputs in its Program's order, its outputs in the op's shapes), else vLLM's path; counted."""
    a = _named(kind, args, kwargs)
    if kind.form.rotary:
        return _run_rotary(rt, kind, a)
    if kind.form.experts:
        return _run_experts(rt, kind, a)
    f, x = kind.form, a["x"]
    hidden = x.shape[-1]
    weight = a.get("w_gate_up" if f.act else "weight") if f.projection else None
    if f.projection:
        n = out_features(weight, a["out_features"])
        last = n // 2 if f.act else n
        dim = (hidden, last)
    else:
        last = dim = hidden // 2 if f.act else hidden
    same = not f.residual or (a["residual"].shape == x.shape and a["residual"].dtype == x.dtype)
    launcher = rt.pick(kind.name, x, dim, a.get("epsilon")) if same else None
    w = rt.plain_weight(weight) if launcher is not None and f.projection else None
    if launcher is not None and f.projection and w is None:
        rt.counts[kind.name] -= 1  # no plain weight was recorded for this handle
        launcher = None
    outs = _launched(rt, kind, launcher, lambda: _kernel_inputs(kind, a, w, hidden, last))
    if outs is not None:
        y = outs[0] if x.dim() == 2 else outs[0].view(*x.shape[:-1], last)
        if not f.residual:
            return y
        return y, (outs[1] if x.dim() == 2 else outs[1].view(x.shape))
    _missed(rt, kind, x, dim, a.get("epsilon"))
    return vllm_path(rt, kind, a)


def _launched(rt: Runtime, kind: RegionKind, launcher, inputs) -> tuple | None:
    """The kernel's outputs on `inputs()`, or None: no launcher, or the kernel raised (then marked
    failed, and vLLM's path serves its calls from now on)."""
    if launcher is None:
        return None
    try:
        return launcher.run(*inputs())
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - never break serving, not even for SystemExit
        rt.failed_kernel(kind.name, launcher, exc)
        return None


def _missed(rt: Runtime, kind: RegionKind, x: Tensor, dim, eps: float | None) -> None:
    """Count a call vLLM's path serves; at the kind's first such miss, say why where no kernel could."""
    rt.misses[kind.name] += 1
    if kind.name not in rt.explained and dim is not None:
        _explain(rt, kind, x, dim, eps)


def rotary_key(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, head_size: int,
               is_neox: bool) -> tuple | None:
    """A rotary call's key dims (`RegionKind.key_names`: heads, kv_heads, head_dim, rotary_dim,
    max_position, neox), or None where no rotary Program computes it (tokens that are not q's rows,
    a cache of another dtype, positions that are not integers)."""
    tokens = positions.numel()
    if (tokens == 0 or positions.dtype not in (torch.int32, torch.int64) or cos_sin_cache.dim() != 2
            or not (q.dtype == k.dtype == cos_sin_cache.dtype) or q.numel() % (tokens * head_size)
            or k.numel() % (tokens * head_size) or q.shape[0] != tokens):
        return None
    return (q.numel() // (tokens * head_size), k.numel() // (tokens * head_size), head_size,
            cos_sin_cache.shape[1], cos_sin_cache.shape[0], int(bool(is_neox)))


def _run_rotary(rt: Runtime, kind: RegionKind, a: dict) -> tuple[Tensor, Tensor]:
    """Dispatch of a rotary kind: q and k (as vLLM holds them: [tokens, heads * head_dim] views of the
    qkv projection's output, or [tokens, heads, head_dim]) and positions [tokens] viewed as its
    Program's [tokens, heads, head_dim] and [tokens, 1] (copies where q, k are strided views)."""
    q, k, d = a["q"], a["k"], a["head_size"]
    key = rotary_key(a["positions"], q, k, a["cos_sin_cache"], d, a["is_neox"])
    rows = q.reshape(q.shape[0], -1) if key is not None else q
    launcher = rt.pick(kind.name, rows, key, a.get("epsilon")) if key is not None else None
    tokens = q.shape[0]
    outs = _launched(rt, kind, launcher, lambda: [
        q.reshape(tokens, -1, d).contiguous(), k.reshape(tokens, -1, d).contiguous(),
        *((a["q_weight"], a["k_weight"]) if kind.form.norm else ()),
        a["positions"].reshape(tokens, 1).to(torch.int64), a["cos_sin_cache"].contiguous()])
    if outs is not None:
        return outs[0].view(q.shape), outs[1].view(k.shape)
    _missed(rt, kind, q, key, a.get("epsilon"))
    return _vllm_rotary(rt, kind, a)


def experts_dims(w13: Tensor, w2: Tensor, top_k: int) -> tuple[int, int, int, int] | None:
    """An experts kind's key dims (experts, top-k, hidden, intermediate) for plain stacked weights
    w13 [E, 2I, H] and w2 [E, H, I], or None where they are not such a pair."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        return None
    return w13.shape[0], int(top_k), w13.shape[2], w2.shape[2]


def _run_experts(rt: Runtime, kind: RegionKind, a: dict) -> Tensor:
    """Dispatch of an experts kind: x [T, H] and the routing [T, k] as vLLM's experts take them, viewed
    as its Program's x [T, 1, 1, 1, H] and weights [T, k, 1, 1, 1] (in x's dtype); the kernel multiplies
    the plain stacked weights recorded where vLLM's CPU experts packed them (`Runtime.experts`), or the
    given ones where nothing was packed, viewed as w13 [E, 2, I, H] and w2 [E, 1, H, I]. The output is
    [T, H]."""
    x, ids, weights = a["x"], a["topk_ids"], a["topk_weights"]
    packed = rt.experts.get(a["w13"].data_ptr())
    w13, w2 = (packed.w13, packed.w2) if packed is not None else (a["w13"], a["w2"])
    tokens, top_k = ids.shape
    dims = experts_dims(w13, w2, top_k)
    shaped = dims is not None and x.dim() == 2 and x.shape == (tokens, dims[2])
    launcher = rt.pick(kind.name, x, dims, None) if shaped else None
    outs = _launched(rt, kind, launcher, lambda: [
        x.reshape(tokens, 1, 1, 1, -1).contiguous(), ids.to(torch.int32).contiguous(),
        weights.to(x.dtype).reshape(tokens, top_k, 1, 1, 1).contiguous(),
        w13.view(dims[0], 2, dims[3], dims[2]), w2.unsqueeze(1)])
    if outs is not None:
        return outs[0].view(tokens, -1)
    _missed(rt, kind, x, dims, None)
    return vllm_path(rt, kind, a)


def _explain(rt: Runtime, kind: RegionKind, x: Tensor, dim, eps: float | None) -> None:
    """At a kind's first miss that no kernel of the table could have served (another dtype, sizes or
    epsilon than it holds for the kind), one line saying so (`explain.mismatch`)."""
    if rt.table is None or x.device.type != rt.table.device:
        return
    line = mismatch(kind.name, (x.dtype, dim, eps), rt.table.ops.get(kind.name, {}), rt.model)
    if line is not None:
        rt.explained.add(kind.name)
        log.warning("prism-serve: %s ran vLLM's path: %s", kind.name, line)


def _kernel_inputs(kind: RegionKind, a: dict, w: Tensor | None, hidden: int, last: int) -> list[Tensor]:
    """The kernel's inputs, in its Program's order: x (and the residual) as rows, the norm's weight,
    the projection's plain weight (gate and up halves apart) and bias; an activation's two halves."""
    f = kind.form
    x = _rows(a["x"], hidden)
    if not f.projection and f.act:
        return [x[:, :last], x[:, last:]]
    out = [x, *((_rows(a["residual"], hidden),) if f.residual else ())]
    if not f.projection:
        return [*out, a["weight"]]
    out += [a["norm_weight"]] if f.norm else []
    out += [w[:last], w[last:]] if f.act else [w]
    return out + ([a["bias"]] if f.bias else [])


# --- the ops: schemas and fakes once per process, kernels per runtime ---------------------

def schema(kind: RegionKind) -> str:
    """The op's schema, from the kind's argument spec: `(Tensor x, ..., float epsilon) -> Tensor`."""
    args = ", ".join(f"{ARG_TYPES[n]} {n}" + (f"={DEFAULTS[n]}" if n in DEFAULTS else "") for n in kind.args)
    outs = ", ".join("Tensor" for _ in kind.outputs)
    return f"({args}) -> " + (outs if len(kind.outputs) == 1 else f"({outs})")


def _fake(kind: RegionKind):
    def fake(*args, **kwargs):
        a = _named(kind, args, kwargs)
        if kind.form.rotary:
            return torch.empty_like(a["q"]), torch.empty_like(a["k"])
        f, x = kind.form, a["x"]
        if f.experts:
            return torch.empty_like(x)
        if f.projection:
            n = out_features(a["w_gate_up" if f.act else "weight"], a["out_features"])
            y = x.new_empty((*x.shape[:-1], n // 2 if f.act else n))
        else:
            y = x.new_empty((*x.shape[:-1], x.shape[-1] // 2)) if f.act else torch.empty_like(x)
        return (y, torch.empty_like(x)) if f.residual else y
    return fake


@functools.cache
def define() -> torch.library.Library | None:
    """Define every `prism::<kind>` op with its fake, once per process (idempotent; None where an
    earlier import of another copy defined them)."""
    if hasattr(torch.ops.prism, next(iter(KINDS))):
        return None
    lib = torch.library.Library("prism", "FRAGMENT")
    for kind in KINDS.values():
        lib.define(kind.name + schema(kind))
        torch.library.register_fake(f"prism::{kind.name}", _fake(kind), lib=lib)
    return lib


def open_runtime(table: Table | None = None) -> Runtime:
    """A runtime for `table` whose kernels the prism ops now run (the one before it is closed)."""
    define()
    if (old := current()) is not None:
        old.close()
    rt = Runtime(table)
    rt.fallbacks.update(references(rt))
    lib = torch.library.Library("prism", "FRAGMENT")
    for kind in KINDS.values():
        lib.impl(kind.name, functools.partial(run, rt, kind), "CompositeExplicitAutograd")
    rt.own(lib)
    return rt
