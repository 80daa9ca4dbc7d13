"""Regions holding a projection, found by data flow over vLLM's ops in an FX graph (Dynamo's, as
capture sees it, or Inductor's post-grad graph, as the fusion pass sees it): RMSNorm -> projection
(`rmsnorm_linear`, or `fused_add_rmsnorm_linear` when the norm adds the residual; their `_bias`
forms where the projection adds a bias, as Qwen2's qkv), projection -> gated activation (`swiglu`,
`geglu`), RMSNorm -> projection -> gated activation (`rmsnorm_swiglu`, `rmsnorm_geglu`), and the
same on Gemma's norm. The kind is looked up by the structure found (`region_table.kind_of`). A
region matches only where each intermediate value has no other consumer, and its key (dtype, sizes,
epsilon) reads the nodes' fake tensors: a weight of another dtype (a quantized one) or a norm
weight of another dtype gives no key. Capture reports what `find_regions` finds; see `patterns`
for what the graph holds.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor, fx

from prism_serve.optimize.ir.ops import Op
from prism_serve.patch.patterns import VLLM_NORMS, Key
from prism_serve.region_table import OP_KINDS, Form, RegionKind, kind_of


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
        return Op.SILU
    gelu = n.target in (torch.nn.functional.gelu, torch._C._nn.gelu, torch.ops.aten.gelu.default)
    approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    return Op.GELU_TANH if gelu and approximate == "tanh" else None


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
