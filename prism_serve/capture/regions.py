"""Find the fusable regions of a vLLM FX graph, by module (nn_module_stack) and data flow.

Runs in the capture child process on the graph vLLM's Dynamo trace hands to the
capture backend. Each leaf module instance (``layers.0.input_layernorm``) becomes a
group of nodes (for time per module and the single ops: RMSNorm, residual add + RMSNorm,
SiluAndMul). A module holding vLLM's RMSNorm op is a norm whatever its class (vLLM's RMSNorm,
GemmaRMSNorm, the Transformers backend's TPAwareRMSNorm), Gemma's where the op's weight is traced
as a stored weight + 1. The regions holding a projection are found by the fusion pass's own matcher
(`prism_serve.patch.dataflow.find_regions`, by data flow over vLLM's ops, whatever the
model's classes), so capture reports exactly the regions the pass would replace:
RMSNorm -> projection is ``rmsnorm_linear`` (or ``fused_add_rmsnorm_linear`` when the
norm adds a residual), projection -> SiLU*mul is ``swiglu``, RMSNorm -> projection ->
SiLU*mul is ``rmsnorm_swiglu``; one the pass would refuse (a weight of another dtype, a
biased gate_up, ...) is reported unsupported with the matcher's reason. Every region
instance carries its dims, read from the traced fake tensors (so they are the sharded,
per-rank dims), and *refs*: where to read its inputs and outputs at run time, in the argument order of the
optimizer's Program builder. Rotary embedding is found as vLLM's own op (``rotary``, and
``qk_norm_rotary`` where q and k are per-head RMSNorms before it); attention is found as vLLM's
own op and reported unsupported (the IR has no mask), with its dims and refs to the op's own
tensor arguments, so what is reported can be checked; a mixture of experts' routed experts are found
as vLLM's CPU fused MoE op, their stacked weights read from the plain copy the capture child keeps
(`PLAIN_EXPERTS`).

A ref is a dict: ``{"node", "at", "when"}`` reads the value of FX node ``node``
just before or after node ``at`` runs (several ops mutate in place, so the moment
matters), optionally sliced along the last dim (``"span": [lo, hi]``) and
flattened to 2-D (``"rows": true``) or reshaped (``"shape": [-1, ...]``), or cast (``"dtype"``);
``{"param": path, "span": [lo, hi]}`` reads a module's weight, sliced along dim 0 (or, for the
experts, ``"<module>.<weight>"`` reads a stacked weight, reshaped by ``"shape"``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from prism_serve.optimize.ir.ops import Op
from prism_serve.patch import dataflow, patterns
from prism_serve.region_table import EXPERTS_KIND_OF, KINDS, STYLE_DIM, Form, kind_of

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class Group:
    path: str
    cls: str
    nodes: list[fx.Node] = field(default_factory=list)
    ext_inputs: list[fx.Node] = field(default_factory=list)
    ext_outputs: list[fx.Node] = field(default_factory=list)


def _clean_path(raw: str) -> str:
    return re.sub(r"^L\['self'\]\.?", "", raw)


def _module_of(n: fx.Node) -> tuple[str, str] | None:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    return _clean_path(path), name


def module_classes(graph: fx.Graph) -> dict[str, str]:
    """Every module the graph's nodes ran in, at every level of their nn_module_stack (a decoder
    layer, its MLP, its projections), by its path in its role (`region_table.role_path`) -> its class
    name: what the eager-mode class hooks go by."""
    from prism_serve.region_table import role_path

    out: dict[str, str] = {}
    for n in graph.nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            out.setdefault(role_path(_clean_path(path)), cls.__name__ if isinstance(cls, type)
                           else str(cls).rsplit(".", 1)[-1].strip("'>"))
    return out


def module_groups(graph: fx.Graph) -> dict[str, Group]:
    groups: dict[str, Group] = {}
    owner: dict[fx.Node, str] = {}
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        mod = _module_of(n)
        if mod is None:
            continue
        g = groups.setdefault(mod[0], Group(*mod))
        g.nodes.append(n)
        owner[n] = mod[0]
    for g in groups.values():
        for n in g.nodes:
            for a in n.all_input_nodes:
                if a.op != "placeholder" and owner.get(a) != g.path and a not in g.ext_inputs:
                    g.ext_inputs.append(a)
            if any(owner.get(u) != g.path for u in n.users) and n not in g.ext_outputs:
                g.ext_outputs.append(n)
    return groups


def _val(n: fx.Node) -> Any:
    val = n.meta.get("val")
    return n.meta.get("example_value") if val is None else val


def _shape(n: fx.Node) -> tuple:
    val = _val(n)
    return tuple(val.shape) if val is not None and hasattr(val, "shape") else ()


def _dtype(n: fx.Node) -> str:
    val = _val(n)
    return str(val.dtype).removeprefix("torch.") if val is not None and hasattr(val, "dtype") else "float32"


def _last(n: fx.Node) -> int:
    return int(_shape(n)[-1])


def _before(value: fx.Node, at: fx.Node, **extra: Any) -> dict:
    return {"node": value.name, "at": at.name, "when": "before", **extra}


def _after(value: fx.Node, at: fx.Node | None = None, **extra: Any) -> dict:
    return {"node": value.name, "at": (at or value).name, "when": "after", **extra}


def _layer(path: str) -> int | None:
    m = _LAYER.search("." + path)
    return int(m.group(1)) if m else None


@dataclass
class Norm:
    """An RMSNorm instance: its op node, inputs, output (and residual sum when fused)."""

    group: Group
    op: fx.Node
    fused: bool
    x: fx.Node
    residual: fx.Node | None
    weight: fx.Node
    eps: float
    out: fx.Node
    sum: fx.Node | None


def _norm(g: Group) -> Norm | None:
    for n in g.nodes:
        target = str(n.target)  # vLLM's op, as its name reads (a vllm_ir op or prism's of that form)
        if patterns.VLLM_NORMS[True] in target:
            getitems = {u.args[1]: u for u in n.users if u.target is operator.getitem}
            if 0 not in getitems:
                return None
            return Norm(g, n, True, n.args[0], n.args[1], n.args[2], float(n.args[3]), getitems[0], getitems.get(1))
        if patterns.VLLM_NORMS[False] in target:
            return Norm(g, n, False, n.args[0], None, n.args[1], float(n.args[2]), n, None)
    return None


def _region(kind: str, g: list[Group], dims: dict, dtype: str, inputs: list, outputs: list,
            eps: float | None = None, supported: bool = True, reason: str | None = None) -> dict:
    return {"kind": kind, "layer": _layer(g[0].path), "modules": [x.path for x in g], "dims": dims,
            "eps": eps, "dtype": dtype, "supported": supported, "reason": reason, "inputs": inputs, "outputs": outputs}


def find_regions(graph: fx.Graph) -> tuple[list[dict], dict[str, Group]]:
    """All region instances of the graph, in graph order."""
    groups = module_groups(graph)
    regions: list[dict] = []
    for g in groups.values():
        nm = _norm(g)
        if nm is not None:
            regions += _norm_regions(g, nm)
        elif "RMSNorm" in g.cls:
            regions.append(_region(kind_of(Form("gemma" if "Gemma" in g.cls else "rms")).name, [g], {}, "float32", [], [],
                                   supported=False, reason=f"{g.cls} not traced as a vllm_ir rms_norm op"))
        elif g.cls in ("SiluAndMul", "GeluAndMul") and g.ext_inputs and g.ext_outputs:
            regions.append(_act_region(g))
        elif "RotaryEmbedding" in g.cls:
            regions += _rotary_regions(g, groups)
        elif g.cls == "Attention":
            regions.append(_attention_region(g))
        elif any(EXPERTS_OP in str(n.target) for n in g.nodes):
            regions.append(_experts_region(g))
    return regions + projection_regions(graph), groups


def _act_region(g: Group) -> dict:
    """SiluAndMul, or GeluAndMul with approximate="tanh" (Gemma's): the gate function of the halves."""
    x, y = g.ext_inputs[0], g.ext_outputs[0]
    inter = _last(y)
    kind = kind_of(Form(act=Op.SILU)).name
    if g.cls == "GeluAndMul":
        fns = {dataflow.act_fn(n) for n in g.nodes} - {None}
        tanh = kind_of(Form(act=Op.GELU_TANH)).name
        if fns != {Op.GELU_TANH}:
            return _region("gelu_and_mul", [g], {}, _dtype(y), [], [], supported=False,
                           reason="GeluAndMul with exact GELU (approximate='none'): only the tanh form has a "
                                  f"region kind ({tanh})")
        kind = tanh
    return _region(kind, [g], {"intermediate": inter}, _dtype(y),
                   [_before(x, g.nodes[0], span=[0, inter]), _before(x, g.nodes[0], span=[inter, 2 * inter])],
                   [_after(y, g.nodes[-1])])


def _norm_regions(g: Group, nm: Norm) -> list[dict]:
    """The RMSNorm op of a module, whatever its class (vLLM's RMSNorm, a subclass such as the
    Transformers backend's TPAwareRMSNorm, GemmaRMSNorm): Gemma's kinds where the op's weight is
    traced as a stored weight + 1 (GemmaRMSNorm hands vLLM's op `w.float() + 1.0`)."""
    hidden, dtype = _last(nm.x), _dtype(nm.out)
    rows = len(_shape(nm.x)) > 2  # q/k norm: one row per (token, head); [1, tokens, hidden] (Transformers backend)
    extra = {"rows": True} if rows else {}
    dims = {"hidden": hidden} | ({"rows_per_token": _rows_per_token(_shape(nm.x))} if rows else {})
    w = _before(nm.weight, nm.op)
    raw = dataflow.gemma_weight(nm.weight)
    gemma = raw is not None and _dtype(raw[0]) == dtype
    kind = kind_of(Form("gemma" if gemma else "rms", nm.fused)).name
    if gemma:
        w = _before(raw[0], raw[1])  # read where the offset chain reads it (the Interpreter frees it after)
    elif _dtype(nm.weight) != dtype:
        return [_region(kind, [g], {}, dtype, [], [], supported=False,
                        reason=f"norm weight dtype {_dtype(nm.weight)} is not the activation's ({dtype})")]
    if nm.fused:
        out = [_after(nm.out)] + ([_after(nm.sum)] if nm.sum is not None else [])
        return [_region(kind, [g], dims, dtype,
                        [_before(nm.x, nm.op, **extra), _before(nm.residual, nm.op, **extra), w], out, nm.eps)]
    return [_region(kind, [g], dims, dtype, [_before(nm.x, nm.op, **extra), w],
                    [_after(nm.out, **extra)], nm.eps)]


def _rows_per_token(shape: tuple) -> int:
    """Rows of a norm's input per token: the product of its leading dims other than the token dim,
    which is the one symbolic dim (vLLM compiles with num_tokens dynamic): heads for a q/k norm
    ([tokens, heads, head_dim]), 1 for [1, tokens, hidden]."""
    lead = shape[:-1]
    symbolic = [i for i, d in enumerate(lead) if not isinstance(d, int)]
    if len(symbolic) != 1:  # all static (a graph traced at one size): the dim before the features
        return int(lead[-1])
    out = 1
    for i, d in enumerate(lead):
        out *= 1 if i == symbolic[0] else int(d)
    return out


def _path(n: fx.Node | None) -> str | None:
    mod = _module_of(n) if n is not None else None
    return mod[0] if mod else None


def _projection_region(r: dataflow.Region) -> dict | None:
    """A matched region as capture reports it: modules, dims, and refs in the Program builder's order."""
    lin, norm = r.linear, r.norm
    at = lin.done or lin.out  # where the projection's result is complete
    paths = [p for p in (_path(norm.node) if norm else None, _path(at), _path(r.act)) if p]
    if not paths or _path(at) is None:
        return None
    x = norm.x if norm else lin.x
    dtype = _dtype(x)
    layer = _layer(paths[0])
    if r.key is None:
        return {"kind": r.kind, "layer": layer, "modules": paths, "dims": {}, "eps": norm.eps if norm else None,
                "dtype": dtype, "supported": False, "reason": r.why, "inputs": [], "outputs": []}
    hidden, n = r.key[1]
    form = KINDS[r.kind].form
    param = {"param": _path(at)}
    halves = [param | {"span": [0, n]}, param | {"span": [n, 2 * n]}]
    if form.norm is None:
        first = lin.nodes[0]
        inputs, dims = [_before(lin.x, first), *halves], {"hidden": hidden, "intermediate": n}
    else:
        if norm.residual is not None and norm.sum is None:
            return None  # the residual sum is never read: nothing to record it from
        # a Gemma norm's stored weight, read where its offset chain reads it (the Interpreter frees it after)
        w = _before(norm.weight, norm.weight_read or norm.node)
        x_ref = _after(norm.sum) if norm.residual is not None else _before(norm.x, norm.node)
        if form.act:
            inputs, dims = [x_ref, w, *halves], {"hidden": hidden, "intermediate": n}
        elif form.residual:
            inputs, dims = [_before(norm.x, norm.node), _before(norm.residual, norm.node), w, param], \
                {"hidden": hidden, "out": n}
        else:
            inputs, dims = [x_ref, w, param], {"hidden": hidden, "out": n}
        if form.bias:  # the projection's bias, as the graph hands it to the GEMM
            inputs.append(_before(lin.bias, lin.nodes[0]))
    if r.act is not None:
        outputs = [_after(r.act)]
    else:
        outputs = [_after(lin.out, at)] + ([_after(norm.sum)] if form.residual else [])
    return {"kind": r.kind, "layer": layer, "modules": paths, "dims": dims, "eps": norm.eps if norm else None,
            "dtype": dtype, "supported": True, "reason": None, "inputs": inputs, "outputs": outputs}


def projection_regions(graph: fx.Graph) -> list[dict]:
    """The regions holding a projection, as the fusion pass's matcher finds them."""
    return [d for d in map(_projection_region, dataflow.find_regions(graph)) if d is not None]


ATTENTION_REASON = ("paged-KV attention over ragged sequences (per-sequence kv_len read through the block "
                    "table, causal within a prefill); the IR has no masking and its attention "
                    "Program has one fixed kv_len")


def _heads(x: fx.Node, head_dim: int) -> int:
    shape = _shape(x)
    return int(shape[-1]) // head_dim if len(shape) == 2 else int(shape[-2])


def _rotary_regions(g: Group, groups: dict[str, Group]) -> list[dict]:
    """vLLM's `_C.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)`, in place on q
    and k, as a `rotary` region; and where q and k are (views of) per-head RMSNorms of one epsilon
    (Qwen3, OLMo 2), also as a `qk_norm_rotary` region spanning the norms' modules too. Refs read q and k
    as the Programs take them ([tokens, heads, head_dim]) and positions as [tokens, 1]."""
    rot_kind, qk_kind = kind_of(Form(rotary=True)).name, kind_of(Form("rms", rotary=True)).name
    rot = next((n for n in g.nodes if "rotary_embedding" in str(n.target) and len(n.args) >= 6), None)
    if rot is None:
        return [_region(rot_kind, [g], {}, "float32", [], [], supported=False,
                        reason=f"{g.cls} not traced as vLLM's _C.rotary_embedding op")]
    positions, q, k, head_dim, cache, neox = rot.args[:6]
    if k is None:
        return [_region(rot_kind, [g], {}, _dtype(q), [], [], supported=False,
                        reason="rotary of q alone (no k: cross-layer KV sharing); the rotary Programs rotate both")]
    try:
        head_dim = int(head_dim)
        dims = {"heads": _heads(q, head_dim), "kv_heads": _heads(k, head_dim), "head_dim": head_dim,
                "rotary_dim": int(_shape(cache)[-1]), "max_position": int(_shape(cache)[0]), STYLE_DIM: int(bool(neox))}
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        return [_region(rot_kind, [g], {}, "float32", [], [], supported=False,
                        reason="rotary_embedding op traced without tensor shapes")]
    qs, ks = [-1, dims["heads"], head_dim], [-1, dims["kv_heads"], head_dim]
    pos, tab = _before(positions, rot, shape=[-1, 1]), _before(cache, rot)
    outputs = [_after(q, rot, shape=qs), _after(k, rot, shape=ks)]
    out = [_region(rot_kind, [g], dims, _dtype(q), [_before(q, rot, shape=qs), _before(k, rot, shape=ks), pos, tab],
                   outputs)]
    norms = [dataflow.norm_at(_unview(x)) for x in (q, k)]
    if all(nm is not None and nm.residual is None and not nm.gemma for nm in norms) and norms[0].eps == norms[1].eps:
        paths = [_path(nm.node) for nm in norms]
        if all(p in groups for p in paths):
            qn, kn = norms
            inputs = [_before(qn.x, qn.node, shape=qs), _before(kn.x, kn.node, shape=ks),
                      _before(qn.weight, qn.node), _before(kn.weight, kn.node), pos, tab]
            out.append(_region(qk_kind, [groups[paths[0]], groups[paths[1]], g], dims, _dtype(q), inputs, outputs,
                               qn.eps))
    return out


def _unview(n):
    """`n` through views (Qwen3 norms q viewed by head, then views it back)."""
    while isinstance(n, fx.Node) and dataflow._is_view(n):
        n = n.args[0]
    return n


EXPERTS_OP = "cpu_fused_moe"  # vLLM's CPU build's fused MoE: (out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, ...)
# where the capture child keeps each MoE layer's plain stacked weights, before vLLM's CPU experts pack them
# (`child._keep_plain_experts`): a param ref "<experts module>.<weight>" reads them
PLAIN_EXPERTS = "_prism_plain_experts"
EXPERTS_WEIGHTS = ("w13_weight", "w2_weight")


def _experts_region(g: Group) -> dict:
    """vLLM's CPU fused MoE of a layer's routed experts (after its router), as an experts kind by its
    activation, where the weights are traced as [experts, 2 * intermediate, hidden] and
    [experts, hidden, intermediate]. Its refs, in the Program's order and shapes: the op's x, top-k
    ids (as int32) and weights (in x's dtype, as the plugin hands them to the kernel) before it runs,
    the layer's plain stacked weights (param refs to what the capture child kept before vLLM packed
    them), and the output the op writes in place."""
    op = next(n for n in g.nodes if EXPERTS_OP in str(n.target))
    out, x, w13, w2 = (op.args[i] if len(op.args) > i else None for i in (0, 1, 2, 3))
    topk_weights, topk_ids = (op.args[i] if len(op.args) > i else None for i in (6, 7))
    act = next((a for a in op.args[8:] if isinstance(a, str)), None)
    if act not in EXPERTS_KIND_OF:
        return _region(kind_of(Form(act=Op.SILU, experts=True)).name, [g], {}, "float32", [], [], supported=False,
                       reason=f"routed experts with the {act!r} activation: the experts kinds take "
                              f"{', '.join(sorted(EXPERTS_KIND_OF))}")
    kind = EXPERTS_KIND_OF[act].name
    nodes = (out, x, w13, w2, topk_weights, topk_ids)
    shapes = [_shape(n) if isinstance(n, fx.Node) else () for n in nodes]
    dtype = _dtype(x) if isinstance(x, fx.Node) else "float32"
    if [len(s) for s in shapes] == [2, 2, 3, 3, 2, 2]:
        _, (_, hidden), (experts, rows, cols), (experts2, h2, inter), _, (_, top_k) = shapes
        if isinstance(hidden, int) and (rows, cols, experts2, h2) == (2 * inter, hidden, experts, hidden):
            e, k, h, i = (int(d) for d in (experts, top_k, hidden, inter))
            dims = {"num_experts": e, "top_k": k, "hidden": h, "intermediate": i}
            inputs = [_before(x, op, shape=[-1, 1, 1, 1, h]), _before(topk_ids, op, dtype="int32"),
                      _before(topk_weights, op, shape=[-1, k, 1, 1, 1], dtype=dtype),
                      {"param": f"{g.path}.{EXPERTS_WEIGHTS[0]}", "shape": [e, 2, i, h]},
                      {"param": f"{g.path}.{EXPERTS_WEIGHTS[1]}", "shape": [e, 1, h, i]}]
            return _region(kind, [g], dims, dtype, inputs, [_after(out, op, shape=[-1, 1, 1, 1, h])])
    return _region(kind, [g], {}, dtype, [], [], supported=False,
                   reason=f"routed experts whose stacked weights are traced as {shapes[2]} and {shapes[3]}, not "
                          f"[experts, 2 * intermediate, hidden] and [experts, hidden, intermediate]")


def _attention_region(g: Group) -> dict:
    """vLLM's `unified_attention_with_output(query, key, value, output, layer)`, writing `output` in place."""
    attn = next((n for n in g.nodes if "unified_attention" in str(n.target)), None)
    if attn is None or len(attn.args) < 3:
        return _region("attention", [g], {}, "float32", [], [], supported=False,
                       reason="Attention not traced as vLLM's unified_attention op")
    q, k, v = attn.args[:3]
    dims: dict[str, int] = {}
    if len(_shape(q)) == 3 and len(_shape(k)) == 3:
        dims = {"heads": int(_shape(q)[1]), "kv_heads": int(_shape(k)[1]), "head_dim": int(_shape(q)[2])}
    out = attn.args[3] if len(attn.args) >= 4 and isinstance(attn.args[3], fx.Node) else None
    inputs = [_before(x, attn) for x in (q, k, v)] if out is not None else []
    outputs = [_after(out, attn)] if out is not None else []
    return _region("attention", [g], dims, _dtype(q), inputs, outputs, supported=False, reason=ATTENTION_REASON)
