"""Rotary embedding (and the QK-norm before it) found by data flow in Inductor's post-grad graph, as
the fusion pass sees vLLM's model: the regions of the rotary kinds (`region_table.ROTARY_KINDS`).

vLLM 0.32's CPU build compiles with custom ops off (`custom_ops: ["none"]`), so its rotary arrives
in the native form of `RotaryEmbedding.forward_static` (vLLM issue #28042), decomposed:

    cs = index(cos_sin_cache, [positions])      (or index_select(cos_sin_cache, 0, positions))
    cos, sin = split(cs, R/2, -1)               (getitems 0 and 1: the cache's two halves)
    per x of q, k ([tokens, heads, D], x[..., :R] when R < D):
      NeoX:  x1, x2 = split(x_rot, R/2, -1);  GPT-J: x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
      o1 = x1 * unsqueeze(cos, -2) - x2 * unsqueeze(sin, -2);  o2 = x2 * cos' + x1 * sin'
      NeoX: cat([o1, o2], -1);  GPT-J: view(cat([unsqueeze(o1, -1), unsqueeze(o2, -1)], -1), [..., R])
      then cat([that, x[..., R:]], -1) when R < D

Where custom ops are on it is `auto_functionalized(_C.rotary_embedding, positions=, query=,
key=, head_size=, cos_sin_cache=, is_neox=)`, its getitems 1 and 2 the rotated q and k. A region
is one rotation of q and one of k by the same gathered cos/sin rows (q is the side with more heads);
where both sides' inputs are the per-head RMSNorm of q and k (vLLM's native body, prism's
`rms_norm` op or vLLM's IR op) with one epsilon, the region is QK-norm + rotary. Near misses stay
vLLM's: sides rotated by different caches (another rotary base), a split that is not half the
rotated width, sin and cos swapped, a cos or sin taken from elsewhere.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from prism_serve.patch import dataflow
from prism_serve.patch.patterns import Key
from prism_serve.region_table import Form, RegionKind, kind_of

ROTARY, QK_NORM_ROTARY = kind_of(Form(rotary=True)), kind_of(Form("rms", rotary=True))
_END = 2 ** 62  # a slice's "to the end" as Inductor's graph writes it (sys.maxsize) is above this


@dataclass(frozen=True)
class Side:
    """The rotation of one of q, k: its input x ([tokens, heads, D]), output and own nodes."""

    x: fx.Node
    out: fx.Node
    gather: fx.Node  # the cos/sin split both halves come from
    rotary_dim: int
    neox: bool
    nodes: frozenset[fx.Node]


@dataclass(frozen=True)
class QkNorm:
    """The per-head RMSNorm feeding a side: its input, weight, epsilon and own nodes."""

    x: fx.Node
    weight: fx.Node
    eps: float
    nodes: frozenset[fx.Node]


@dataclass(frozen=True)
class Rotary:
    """One rotary region: vLLM's op's arguments, the rotated q and k, and what the region replaces."""

    kind: RegionKind
    key: Key | None  # None: matched, but no rotary Program computes it (dtypes differ, ...)
    positions: fx.Node
    cache: fx.Node
    q: fx.Node  # the region's q and k inputs (before the norm, for QK-norm + rotary)
    k: fx.Node
    head_size: int
    neox: bool
    q_out: fx.Node
    k_out: fx.Node
    nodes: frozenset[fx.Node]
    rotated: tuple[fx.Node, fx.Node]  # what the rotation reads: q and k, or their norms' outputs
    norms: tuple[QkNorm, QkNorm] | None = None

    def without_norm(self) -> Rotary | None:
        """The rotation alone of a QK-norm + rotary region (its norms stay vLLM's), keyed as rotary."""
        if self.norms is None:
            return None
        q, k = self.rotated
        nodes = self.nodes - self.norms[0].nodes - self.norms[1].nodes
        key = _key(ROTARY, self.positions, self.cache, q, k, self.head_size, self.neox, self.key[1][3], None) \
            if self.key is not None else None
        return Rotary(ROTARY, key, self.positions, self.cache, q, k, self.head_size, self.neox, self.q_out, self.k_out,
                      frozenset(nodes), self.rotated)


@functools.cache
def _packets(names: tuple[str, ...]) -> frozenset:
    """The op packets `namespace::name` this process has (any overload: aten's slice has no default)."""
    out = set()
    for name in names:
        ns, op = name.split("::")
        try:
            out.add(getattr(getattr(torch.ops, ns), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(out)


def _call(n, *names: str) -> bool:
    """`n` calls one of the ops `names` (any overload)."""
    return (isinstance(n, fx.Node) and n.op == "call_function"
            and getattr(n.target, "_overloadpacket", None) in _packets(names))


def _val(n) -> Tensor | None:
    return dataflow._val(n)


def _last(n) -> int | None:
    v = _val(n)
    return int(v.shape[-1]) if v is not None and v.dim() and isinstance(v.shape[-1], int) else None


def _dim_is_last(n: fx.Node, dim) -> bool:
    v = _val(n)
    return v is not None and dim in (-1, v.dim() - 1)


def _strip(n):
    """`n` through unsqueezes and dtype conversions (how vLLM broadcasts cos / sin over heads)."""
    seen = []
    while _call(n, "aten::unsqueeze", "prims::convert_element_type", "aten::_to_copy"):
        seen.append(n)
        n = n.args[0]
    return n, seen


def _halves(a, b) -> tuple[fx.Node, int, tuple[fx.Node, ...]] | None:
    """(the split value, its split size, the split's nodes) when a, b are getitems 0 and 1 of one split of
    a value along its last dim into two halves."""
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.target is operator.getitem
            and b.target is operator.getitem and same(a.args[0], b.args[0]) and (a.args[1], b.args[1]) == (0, 1)):
        return None
    s = a.args[0]
    if _call(s, "aten::split") and len(s.args) >= 2:
        size, dim = s.args[1], s.args[2] if len(s.args) > 2 else 0
    elif _call(s, "aten::split_with_sizes") and len(s.args[1]) == 2 and s.args[1][0] == s.args[1][1]:
        size, dim = s.args[1][0], s.args[2] if len(s.args) > 2 else 0
    else:
        return None
    src = s.args[0]
    if not (isinstance(size, int) and _dim_is_last(src, dim) and _last(src) == 2 * size):
        return None
    return src, size, (a, b, s)


def same(a, b, depth: int = 8) -> bool:
    """a and b compute the same value: the same node, or calls of one op on the same arguments.
    Inductor's post-grad graph repeats the qkv split and the head views for every slice vLLM takes
    of them (GPT-J's even and odd columns, the pass-through part), so one value has several nodes."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth == 0:
        return a == b if not isinstance(a, fx.Node) and not isinstance(b, fx.Node) else False
    if a.op != "call_function" or b.op != "call_function" or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if len(a.args) != len(b.args):
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y) or not all(same(i, j, depth - 1) for i, j in zip(x, y)):
                return False
        elif not same(x, y, depth - 1):
            return False
    return True


def _pairs(a, b) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(x, nodes) when a, b are x[..., 0::2] and x[..., 1::2] (GPT-J's pairs) over x's whole last dim."""
    if not (_call(a, "aten::slice") and _call(b, "aten::slice") and same(a.args[0], b.args[0])):
        return None
    x = a.args[0]
    width = _last(x)

    def ok(s, start):
        dim, lo, hi, step = (list(s.args[1:]) + [0, None, _END, 1][len(s.args) - 1:])[:4]
        return _dim_is_last(x, dim) and lo == start and step == 2 and (hi is None or hi >= width)
    return (x, (a, b)) if width and ok(a, 0) and ok(b, 1) else None


def _products(n, op: str) -> tuple[tuple, tuple] | None:
    """n = op(mul(a, b), mul(c, d)): ((a, b), (c, d)) with the cos/sin factor second in each."""
    if not (_call(n, op) and len(n.args) == 2 and all(_call(m, "aten::mul") for m in n.args)):
        return None
    return tuple(tuple(m.args) for m in n.args)


def _factor(pair, x) -> fx.Node | None:
    """The other factor of a product holding `x`."""
    a, b = pair
    return b if a is x else a if b is x else None


def _rotation(o1, o2, x1, x2) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]] | None:
    """(cos, sin, nodes) when o1 = x1*cos - x2*sin and o2 = x2*cos + x1*sin."""
    p1, p2 = _products(o1, "aten::sub"), _products(o2, "aten::add")
    if p1 is None or p2 is None:
        return None
    c1, s1, c2, s2 = _factor(p1[0], x1), _factor(p1[1], x2), _factor(p2[0], x2), _factor(p2[1], x1)
    if None in (c1, s1, c2, s2):
        return None
    (cos, a), (sin, b), (cos2, c), (sin2, d) = map(_strip, (c1, s1, c2, s2))
    if not (same(cos, cos2) and same(sin, sin2)):
        return None
    return cos, sin, (o1, o2, *o1.args, *o2.args, *a, *b, *c, *d)


def side_at(n: fx.Node) -> Side | None:
    """`n` as the rotated value of one of q, k (see the module docstring), or None."""
    x_full, extra = None, ()
    if _call(n, "aten::cat") and len(n.args[0]) == 2 and _dim_is_last(n, n.args[1] if len(n.args) > 1 else 0):
        rot, rest = n.args[0]
        if _call(rest, "aten::slice") and _call(rot, "aten::cat", *dataflow.VIEWS):
            x_full, extra = rest.args[0], (rest,)
            n_rot = rot
        else:
            n_rot = n
    elif _call(n, *dataflow.VIEWS):
        n_rot = n
    else:
        return None
    found = _neox(n_rot) or _gptj(n_rot)
    if found is None:
        return None
    xr, cos, sin, nodes, neox = found
    while _call(xr, "aten::alias"):  # x[..., :D] of a whole head, as make_fx traces it
        xr = xr.args[0]
    cs = _halves(cos, sin)
    if cs is None or not _call(cs[0], "aten::index", "aten::index_select"):
        return None
    width = _last(xr)
    if x_full is not None:  # partial rotary: x[..., :R] rotated, x[..., R:] passed through
        if not (_call(xr, "aten::slice") and same(xr.args[0], x_full) and _slice(xr, x_full) == (0, width)
                and _slice(extra[0], x_full) == (width, _last(x_full))):
            return None
        x, nodes = x_full, (*nodes, xr, *extra, n)
    else:
        x = xr
    if width != 2 * cs[1]:
        return None
    return Side(x, n, cs[0], width, neox, frozenset((*nodes, *cs[2], cs[0])))  # the gather: erased once unread


def _slice(s: fx.Node, x: fx.Node) -> tuple[int, int] | None:
    """(start, stop) of a step-1 slice of x along its last dim (stop clipped to x's width)."""
    dim, lo, hi, step = (list(s.args[1:]) + [0, None, _END, 1][len(s.args) - 1:])[:4]
    if not _dim_is_last(x, dim) or step != 1:
        return None
    return (lo or 0), min(hi if hi is not None else _END, _last(x) or 0)


def _neox(n: fx.Node):
    if not (_call(n, "aten::cat") and len(n.args[0]) == 2):
        return None
    o1, o2 = n.args[0]
    for a in (o1, o2):
        if not _call(a, "aten::sub", "aten::add"):
            return None
    x1, x2 = _inputs_of(o1)
    if x1 is None:
        return None
    h = _halves(x1, x2)
    if h is None:
        return None
    rot = _rotation(o1, o2, x1, x2)
    return None if rot is None else (h[0], rot[0], rot[1], (*rot[2], *h[2], n), True)


def _gptj(n: fx.Node):
    cat = n.args[0] if _call(n, *dataflow.VIEWS) else None
    if _call(cat, "aten::stack") and len(cat.args[0]) == 2 and _dim_is_last(n, -1) and cat.args[1:] in ((-1,), (3,)):
        o1, o2 = cat.args[0]  # stack((o1, o2), -1), where the graph keeps it (make_fx; Inductor decomposes it)
        unsqueezed = ()
    elif _call(cat, "aten::cat") and len(cat.args[0]) == 2 and all(_call(u, "aten::unsqueeze") for u in cat.args[0]):
        o1, o2 = (u.args[0] for u in cat.args[0])
        unsqueezed = tuple(cat.args[0])
    else:
        return None
    x1, x2 = _inputs_of(o1)
    if x1 is None:
        return None
    p = _pairs(x1, x2)
    rot = _rotation(o1, o2, x1, x2) if p is not None else None
    return None if rot is None else (p[0], rot[0], rot[1], (*rot[2], *p[1], *unsqueezed, cat, n), False)


def _inputs_of(o1) -> tuple:
    """(x1, x2) of o1 = x1*cos - x2*sin: the products' first factors that are not broadcast cos / sin."""
    p = _products(o1, "aten::sub")
    if p is None:
        return None, None
    firsts = []
    for a, b in p:
        firsts.append(b if _call(a, "aten::unsqueeze") and not _call(b, "aten::unsqueeze") else a)
    return tuple(firsts)


def norm_before(x: fx.Node) -> QkNorm | None:
    """The per-head RMSNorm whose output is `x`, in any of the forms the graph holds it: prism's op or
    vLLM's IR op (`dataflow.norm_at`), or vLLM's native body (x.float() * rsqrt(mean(x^2) + eps), cast
    back, times the weight)."""
    found = dataflow.norm_at(x)
    if found is not None and found.residual is None and not found.gemma:
        return QkNorm(found.x, found.weight, found.eps, frozenset({x}))
    nodes = []
    n = _under_cast(x, nodes)
    if not (_call(n, "aten::mul") and len(n.args) == 2):
        return None
    normed, weight = n.args
    nodes.append(n)
    normed = _under_cast(normed, nodes)
    if not (_call(normed, "aten::mul") and len(normed.args) == 2):
        return None
    xf, r = normed.args
    nodes.append(normed)
    if not _call(r, "aten::rsqrt") or not _call(r.args[0], "aten::add"):
        return None
    add = r.args[0]
    mean, eps = add.args
    if not (_call(mean, "aten::mean") and isinstance(eps, float) and _call(mean.args[0], "aten::pow")
            and mean.args[0].args[0] is xf and mean.args[0].args[1] == 2 and list(mean.args[1]) in ([-1], [2])):
        return None
    nodes += [r, add, mean, mean.args[0]]
    return QkNorm(_under_cast(xf, nodes), weight, eps, frozenset(nodes))


def _under_cast(n: fx.Node, nodes: list) -> fx.Node:
    """What `n` casts when it is a dtype cast (the cast then added to `nodes`), else `n`."""
    if _call(n, "prims::convert_element_type", "aten::_to_copy"):
        nodes.append(n)
        return n.args[0]
    return n


def _custom_op(n: fx.Node) -> Rotary | None:
    """`auto_functionalized(_C.rotary_embedding, ...)` (custom ops on) as a rotary region."""
    op = dataflow._op("_C::rotary_embedding")
    if not (n.target is torch.ops.higher_order.auto_functionalized and n.args and n.args[0] is op and op is not None):
        return None
    kw = n.kwargs
    items = {u.args[1]: u for u in n.users if u.target is operator.getitem}
    if not {1, 2} <= set(items) or not isinstance(kw.get("key"), fx.Node) or not isinstance(kw.get("head_size"), int):
        return None
    cache = kw["cos_sin_cache"]
    return _region(kw["positions"], cache, kw["query"], kw["key"], kw["head_size"], bool(kw["is_neox"]), items[1],
                   items[2], frozenset({n, *items.values()}), _last(cache))


def _region(positions, cache, q, k, head_size: int, neox: bool, q_out, k_out, nodes, rotary_dim) -> Rotary:
    """The region of a rotation of q and k: QK-norm + rotary where both inputs are per-head RMSNorms of
    one epsilon (peeled off views: Qwen3 norms q viewed by head), else rotary; its key from the fake values."""
    rotated = (q, k)
    qn, kn = (norm_before(_unview(x)) for x in (q, k))
    kind, norms = ROTARY, None
    if qn is not None and kn is not None and qn.eps == kn.eps:
        kind, norms = QK_NORM_ROTARY, (qn, kn)
        nodes = nodes | qn.nodes | kn.nodes
        q, k = qn.x, kn.x
    key = _key(kind, positions, cache, q, k, head_size, neox, rotary_dim, norms)
    return Rotary(kind, key, positions, cache, q, k, head_size, neox, q_out, k_out, frozenset(nodes), rotated, norms)


def _unview(x: fx.Node) -> fx.Node:
    while _call(x, *dataflow.VIEWS, "aten::alias"):
        x = x.args[0]
    return x


def _key(kind, positions, cache, q, k, head_size, neox, rotary_dim, norms) -> Key | None:
    vals = [_val(n) for n in (positions, cache, q, k)]
    if any(v is None for v in vals) or rotary_dim is None:
        return None
    pos, c, qv, kv = vals
    if (pos.dtype not in (torch.int32, torch.int64) or c.dim() != 2 or c.shape[1] != rotary_dim
            or not (qv.dtype == kv.dtype == c.dtype) or any(v.dim() not in (2, 3) for v in (qv, kv))
            or any(v.shape[-1] % head_size or (v.dim() == 3 and v.shape[-1] != head_size) for v in (qv, kv))):
        return None
    heads = [int(v.shape[1]) if v.dim() == 3 else int(v.shape[-1]) // head_size for v in (qv, kv)]
    eps = None
    if norms is not None:
        ws = [_val(nm.weight) for nm in norms]
        if any(w is None or w.dtype != qv.dtype or tuple(w.shape) != (head_size,) for w in ws):
            return None
        eps = norms[0].eps
    return qv.dtype, (heads[0], heads[1], head_size, int(rotary_dim), int(c.shape[0]), int(neox)), eps


def find_rotary(graph: fx.Graph) -> list[Rotary]:
    """Every rotary region of the graph, in graph order: the custom op's, and each pair of native
    rotations sharing one gather of the cache (q the side with more heads, the first on a tie)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: list[Rotary] = []
    sides: dict[fx.Node, list[Side]] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if (r := _custom_op(n)) is not None:
            out.append(r)
        elif (s := side_at(n)) is not None:
            gather = next((g for g in sides if same(g, s.gather)), s.gather)
            sides.setdefault(gather, []).append(s)
    for index, found in sides.items():
        found = sorted((s for s in found if not any(s.out in o.nodes for o in found if o is not s)),  # outermost
                       key=lambda s: order[s.out])
        positions = index.args[1][0] if _call(index, "aten::index") else index.args[2]
        # one gather serves every layer (the positions are the model's): each layer rotates its q, then its k
        for a, b in zip(found[::2], found[1::2]):
            if a.neox != b.neox or a.rotary_dim != b.rotary_dim:
                continue
            head = _last(a.x)
            q, k = sorted((a, b), key=lambda s: (-_heads(s.x), order[s.out]))
            out.append(_region(positions, index.args[0], q.x, k.x, head, q.neox, q.out, k.out, q.nodes | k.nodes,
                               q.rotary_dim))
    return sorted(out, key=lambda r: order[r.q_out])


def _heads(x: fx.Node) -> int:
    v = _val(x)
    return int(v.shape[-2]) if v is not None and v.dim() >= 3 else 0
