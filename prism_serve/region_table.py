"""The one table of region kinds: what each region is, how vLLM runs it today, how prism serves it.

Every other part reads this table rather than naming region kinds itself: capture builds a
region's Program from its dims (`RegionKind.program`), warmup warms only what the plugin would
serve (`served_sites`) and prices vLLM's path as the baseline (`vllm_path`, see
`prism_serve.baseline`), the plugin's dispatch table keys kernels by it (`RegionKind.key_of`),
and the doctor lists where each kind is served.

A row is data, not a name to take apart: `form` is the region's structure (norm variant, residual,
projection, bias, activation, rotary embedding), from which everything else is derived: `parts` / `vllm_path`, the
chain of vLLM ops the region replaces in data-flow order (the baseline), `args` / `outputs`, the
custom op's signature (its schema, the fusion pass's argument order, the kernel's inputs), the
op-level kinds that mark it in a graph (`norm_op`, `act_op`), its form without the residual, and
the kind a structure found in a graph is (`kind_of`). `modules` are the module roles of a decoder
layer it spans (the eager-mode class hooks of `patch.hooks` patch exactly `eager_classes`, whose
modules `MODEL_CLASSES` names; the compiled-mode fusion pass matches vLLM's ops instead, see
`patch.dataflow`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable

from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.ir.program import Program
from prism_serve.optimize.workloads import programs

# vLLM's kernels, as `vllm_path` names them: its fused norm kernels, its activation kernels, its GEMM,
# and Gemma's norm (its RMSNorm op on the float32 weight + 1) and GeluAndMul(approximate="tanh")
VLLM_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "linear", "gemma_rms_norm", "gemma_fused_add_rms_norm",
            "gelu_tanh_and_mul", "rotary_embedding", "fused_moe")
# how the plugin reaches vLLM for a kind (see patch.hooks): an IR provider, a CustomOp replacement,
# a model's MLP class, a decoder layer's modules, only the compiled-mode fusion pass (patch.fusion), or
# vLLM's fused-MoE experts class (patch.experts_hook, in both modes)
HOOKS = ("ir", "custom_op", "mlp", "decoder_layer", "pattern", "experts")


@dataclass(frozen=True)
class Dim:
    """A named size of a region, read from axis `axis` of the Program input `input`."""

    name: str
    input: str
    axis: int


# a norm's variant: vLLM's RMSNorm, or Gemma's (x * rsqrt(mean(x^2) + eps) * (1 + w), on the stored w)
NORMS = ("rms", "gemma")
# a gated activation on the two halves of gate_up's output: SiLU (SwiGLU), tanh-GELU (Gemma's GeGLU)
ACTS = (Op.SILU, Op.GELU_TANH)
# vLLM's names (its MoEActivation values) for the experts kinds' activations
MOE_ACTIVATIONS = MappingProxyType({Op.SILU: "silu", Op.GELU_TANH: "gelu_tanh"})
# rotary embedding's styles (the Programs' `style`) by vLLM's `is_neox_style`: NeoX rotates the two halves
# of the rotated part of each head, GPT-J its interleaved (even, odd) pairs
STYLES = MappingProxyType(dict(zip((True, False), programs.ROTARY_STYLES)))
# a rotary kind's dim that is its style, not a size: 1 for NeoX, 0 for GPT-J (vLLM's `is_neox`)
STYLE_DIM = "neox"


@dataclass(frozen=True)
class Form:
    """A region's structure: what it computes, in data-flow order (norm -> projection -> activation).
    Every other fact about a kind (its vLLM path, its custom op's arguments, which op-level kinds
    mark it in a graph) is derived from this; nothing reads a kind's name."""

    norm: str | None = None  # one of NORMS, or None
    residual: bool = False  # the kernel adds the residual before the norm and writes the sum
    projection: bool = False  # a projection (GEMM) of the normed value, or of x
    bias: bool = False  # the projection adds a bias
    act: str | None = None  # one of ACTS applied to the projection's (or x's) two halves, or None
    # rotary embedding of q and k by position (vLLM's `rotary_embedding`), after a per-head RMSNorm of
    # each (QK-norm) where `norm` is set; its style is a dim of the region (`STYLE_DIM`)
    rotary: bool = False
    # the routed experts of a mixture-of-experts layer (vLLM's fused MoE): each token's top-k experts'
    # gated MLPs with activation `act`, gathered by expert id, summed weighted by the routing weights
    experts: bool = False

    def __post_init__(self) -> None:
        assert self.norm in (None, *NORMS) and self.act in (None, *ACTS), self
        assert not self.residual or self.norm, self
        assert not self.bias or self.projection, self
        assert not self.rotary or (self.norm in (None, "rms")
                                   and not (self.residual or self.projection or self.act)), self
        assert not self.experts or (self.act and not (self.norm or self.projection or self.rotary)), self

    @property
    def size(self) -> int:
        """How many of vLLM's ops the region spans (its norm, projection, activation, rotary)."""
        return (self.norm is not None) + self.projection + (self.act is not None) + self.rotary

    @property
    def label(self) -> str:
        """The structure in words, for a region prism has no kind for (capture reports it unsupported)."""
        parts = (f"{'residual add + ' if self.residual else ''}{self.norm} norm" if self.norm else "",
                 ("biased " if self.bias else "") + "projection" if self.projection else "",
                 f"{self.act}*mul" if self.act and not self.experts else "", "rotary" if self.rotary else "",
                 f"routed {self.act} experts" if self.experts else "")
        return " -> ".join(p for p in parts if p)


@dataclass(frozen=True)
class RegionKind:
    name: str  # the capture kind, the Program name and the prism custom op (prism::<name>)
    build: Callable[..., Program]  # (*dims in `dims` order, dtype, [eps]) -> Program
    dims: tuple[Dim, ...]
    form: Form
    hook: str  # how the plugin serves it (one of HOOKS)
    modules: tuple[str, ...] = ()  # module roles it spans in a decoder layer; () = wherever vLLM runs the op
    doc: str = ""
    # hooks "mlp" and "decoder_layer": the vLLM classes whose instances (exactly) eager mode serves it in,
    # the module holding its modules (`patch.hooks` patches exactly these); rotary's: the rotary classes
    # whose CustomOp replacement serves it
    eager_classes: frozenset[str] = frozenset()
    # the served path runs vLLM's residual add beside the kernel (vLLM folds it into its norm), so the
    # kernel takes the sum; the region in vLLM's graph starts at a residual add + norm
    add_beside: bool = False
    vllm_op: str = ""  # an op-level kind: vLLM's name for its kernel (`VLLM_OPS`), where it is not `name`

    @property
    def has_eps(self) -> bool:
        return self.form.norm is not None

    @property
    def parts(self) -> tuple[RegionKind | str, ...]:
        """vLLM's ops for this region today, in data-flow order: its op-level kinds (norm, activation,
        rotary) and "linear" for its GEMM; an op-level kind is its own single part. QK-norm + rotary is
        vLLM's RMSNorm of q, of k, then its rotary."""
        f = self.form
        if f.size == 1 and not f.projection:
            return (self,)
        if f.rotary:
            return (self.norm_op, self.norm_op, kind_of(Form(rotary=True)))
        norm = kind_of(Form(f.norm, f.residual or self.add_beside)) if f.norm else None
        return tuple(p for p in (norm, "linear" if f.projection else None, kind_of(Form(act=f.act)) if f.act else None)
                     if p is not None)

    @property
    def vllm_path(self) -> tuple[str, ...]:
        """vLLM's kernels for this region today (the baseline), in data-flow order (names of `VLLM_OPS`)."""
        return tuple(p if isinstance(p, str) else p.vllm_op or p.name for p in self.parts)

    @property
    def norm_op(self) -> RegionKind | None:
        """The op-level norm kind of the same variant and residual (the region's norm in a graph)."""
        return kind_of(Form(self.form.norm, self.form.residual)) if self.form.norm else None

    @property
    def act_op(self) -> RegionKind | None:
        """The op-level activation kind of the region's activation."""
        return kind_of(Form(act=self.form.act)) if self.form.act else None

    @property
    def without_residual(self) -> RegionKind | None:
        """The same region with the residual added beside it (fused_add_... -> its plain form), or None."""
        return kind_of(replace(self.form, residual=False)) if self.form.residual else None

    @property
    def args(self) -> tuple[str, ...]:
        """The custom op's arguments, in order: the activations, the norm's and the projection's
        weights, the bias, epsilon; a projection's op also takes the eager hook's `site` and
        `out_features` (the weight may be vLLM's packed handle, which has no shape)."""
        f = self.form
        if f.experts:  # vLLM's experts' apply: the routed tokens, their top-k routing, the stacked weights
            return ("x", "topk_weights", "topk_ids", "w13", "w2")
        if f.rotary:  # vLLM's rotary_embedding's arguments, the QK-norm's weights and epsilon before the cache
            return ("positions", "q", "k", *(("q_weight", "k_weight") if f.norm else ()), "cos_sin_cache",
                    *(("epsilon",) if f.norm else ()), "head_size", "is_neox")
        if not f.projection:
            return ("x",) + (("residual",) if f.residual else ()) + (("weight", "epsilon") if f.norm else ())
        return ("x", *(("residual",) if f.residual else ()), *(("norm_weight",) if f.norm else ()),
                "w_gate_up" if f.act else "weight", *(("bias",) if f.bias else ()),
                *(("epsilon",) if f.norm else ()), "site", "out_features")

    @property
    def outputs(self) -> tuple[str, ...]:
        """The custom op's outputs: the result, and the residual sum where the kernel writes it; rotary's
        rotated q and k (in the shapes of its q and k)."""
        if self.form.rotary:
            return ("q_out", "k_out")
        return ("y", "residual") if self.form.residual else ("y",)

    @property
    def rank(self) -> tuple:
        """Largest region first (more of vLLM's ops; a norm before an activation alone): the order in
        which the fusion pass offers a node to the regions holding it."""
        f = self.form
        return (-f.size, f.norm is None, f.bias, f.norm == "gemma", not f.residual)

    def projection_shape(self, dims: tuple[int, int]) -> tuple[int, int]:
        """(out, in) of the projection weight for key dims (hidden, n): gate_up is [2n, hidden]."""
        hidden, n = dims
        return (2 * n if self.form.act else n), hidden

    def program(self, dims: dict, dtype: str, eps: float | None = None) -> Program:
        """The exact Program for these dims (by name), dtype and epsilon."""
        sizes = [int(dims[d.name]) for d in self.dims]
        style = {"style": STYLES[bool(dims[STYLE_DIM])]} if self.form.rotary else {}
        return self.build(*sizes, dtype, eps, **style) if self.has_eps else self.build(*sizes, dtype, **style)

    def dims_of(self, prog: Program) -> dict[str, int]:
        dims = {d.name: int(prog.by_name[d.input].attr("shape")[d.axis]) for d in self.dims}
        if self.form.rotary:  # GPT-J's rotated pairs are stored interleaved, NeoX's halves side by side
            dims[STYLE_DIM] = int(not any(n.op == Op.CONCAT and n.attr("interleave") for n in prog.nodes))
        return dims

    @property
    def key_names(self) -> tuple[str, ...]:
        """The names of the dims in the dispatch table's key, in order (a rotary kind's style last)."""
        return tuple(d.name for d in self.dims) + ((STYLE_DIM,) if self.form.rotary else ())

    def key_dim(self, dims: dict) -> int | tuple[int, ...]:
        """The dispatch table's dim key: one size, or a tuple of them for a multi-dim region."""
        sizes = tuple(int(dims[n]) for n in self.key_names)
        return sizes[0] if len(sizes) == 1 else sizes

    def key_of(self, prog: Program) -> tuple | None:
        """(dtype, key dim, eps) when `prog` is exactly this kind's Program for them, else None."""
        if prog.name != self.name or any(d.input not in prog.by_name for d in self.dims):
            return None
        dims = self.dims_of(prog)
        dtype = prog.by_name[self.dims[0].input].attr("dtype")
        eps = next((n.attr("eps") for n in prog.nodes if n.op == "rms_norm"), None)
        try:
            expected = self.program(dims, dtype, eps)
        except Exception:  # noqa: BLE001 - a program that cannot even be rebuilt is not this kind
            return None
        return (dtype, self.key_dim(dims), eps) if expected.canonical_hash == prog.canonical_hash else None


_H, _I, _O = Dim("hidden", "x", -1), Dim("intermediate", "w_gate", 0), Dim("out", "w", 0)
# the routed experts: w13 [experts, 2 * intermediate, hidden], topk_ids [tokens, top_k], w2 [experts, hidden, intermediate]
_MOE = (Dim("num_experts", "w13", 0), Dim("top_k", "topk_ids", 1), _H, Dim("intermediate", "w2", -1))
_GATE = (Dim("intermediate", "gate", -1),)
# the vLLM classes eager mode patches (`patch.hooks` imports them from here), by class name -> its module
MODEL_CLASSES: Mapping[str, str] = MappingProxyType({
    "LlamaMLP": "vllm.model_executor.models.llama", "Qwen2MLP": "vllm.model_executor.models.qwen2",
    "LlamaDecoderLayer": "vllm.model_executor.models.llama",
    "MistralDecoderLayer": "vllm.model_executor.models.mistral",
    "Qwen3DecoderLayer": "vllm.model_executor.models.qwen3"})
# vLLM's rotary classes whose forward is RotaryEmbedding's (they differ in the cos/sin cache only, an input
# of the kernel): eager mode replaces exactly these (`patch.rotary_hook`), by class name -> its module
ROTARY_CLASSES: Mapping[str, str] = MappingProxyType(dict.fromkeys(
    ("RotaryEmbedding", "Llama3RotaryEmbedding", "YaRNScalingRotaryEmbedding"),
    "vllm.model_executor.layers.rotary_embedding"))
_MLPS = frozenset({"LlamaMLP", "Qwen2MLP"})  # Qwen3's MLP is Qwen2MLP; GLM-4's, LlamaMLP
_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen3DecoderLayer"})
_QKV = ("input_layernorm", "self_attn.qkv_proj")
_RMS, _GEMMA = "rms", "gemma"
# rotary: q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim], cos_sin_cache [max_position, rotary_dim]
_ROT = (Dim("heads", "q", 1), Dim("kv_heads", "k", 1), Dim("head_dim", "q", 2), Dim("rotary_dim", "cos_sin_cache", 1),
        Dim("max_position", "cos_sin_cache", 0))


def _qk_norm_rotary(heads: int, kv_heads: int, head_dim: int, rotary_dim: int, max_position: int, dtype: str,
                    eps: float, style: str) -> Program:
    """`programs.qk_norm_rotary` in the table's argument order (dims, dtype, eps)."""
    return programs.qk_norm_rotary(heads, kv_heads, head_dim, rotary_dim, max_position, eps, dtype, style)


KINDS: Mapping[str, RegionKind] = MappingProxyType({k.name: k for k in (
    RegionKind("rms_norm", programs.rms_norm, (_H,), Form(_RMS), "ir",
               doc="an RMSNorm without residual (a layer's first input norm, q/k norm)"),
    RegionKind("fused_add_rms_norm", programs.fused_add_rms_norm, (_H,), Form(_RMS, residual=True), "ir",
               doc="residual add + RMSNorm, writing the sum as the next residual"),
    RegionKind("silu_and_mul", programs.silu_and_mul, _GATE, Form(act=Op.SILU), "custom_op",
               doc="SiluAndMul on the two halves of gate_up's output"),
    RegionKind("swiglu", programs.swiglu, (_H, _I), Form(projection=True, act=Op.SILU), "mlp",
               ("mlp.gate_up_proj", "mlp.act_fn"), "an MLP's gate_up projection + SiLU*mul", _MLPS),
    RegionKind("rmsnorm_linear", programs.rmsnorm_linear, (_H, _O), Form(_RMS, projection=True), "decoder_layer",
               _QKV, "a first layer's input RMSNorm (no residual yet) + qkv projection", _LAYERS),
    RegionKind("fused_add_rmsnorm_linear", programs.fused_add_rmsnorm_linear, (_H, _O),
               Form(_RMS, residual=True, projection=True), "decoder_layer", _QKV,
               "a layer's input residual add + RMSNorm + qkv projection; the kernel writes the residual", _LAYERS),
    # a projection that adds a bias (Qwen2's qkv): served by the compiled-mode fusion pass only
    RegionKind("rmsnorm_linear_bias", programs.rmsnorm_linear_bias, (_H, _O), Form(_RMS, projection=True, bias=True),
               "pattern", _QKV, "a first layer's input RMSNorm + a qkv projection with a bias"),
    RegionKind("fused_add_rmsnorm_linear_bias", programs.fused_add_rmsnorm_linear_bias, (_H, _O),
               Form(_RMS, residual=True, projection=True, bias=True), "pattern", _QKV,
               "a layer's input residual add + RMSNorm + a qkv projection with a bias; the kernel writes the "
               "residual"),
    RegionKind("rmsnorm_swiglu", programs.rmsnorm_swiglu, (_H, _I), Form(_RMS, projection=True, act=Op.SILU),
               "decoder_layer", ("post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn"),
               "the post-attention residual add + RMSNorm + gate_up projection + SiLU*mul; the add runs "
               "as one elementwise kernel before it (vLLM folds it into its norm), the rest as one kernel", _LAYERS,
               add_beside=True),
    # Gemma (GemmaRMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) in float32; GeluAndMul(approximate="tanh")),
    RegionKind("gelu_tanh_and_mul", programs.gelu_tanh_and_mul, _GATE, Form(act=Op.GELU_TANH), "custom_op",
               doc="GeluAndMul(approximate='tanh') on the two halves of gate_up's output"),
    # served by the compiled-mode fusion pass only
    RegionKind("gemma_rms_norm", programs.gemma_rms_norm, (_H,), Form(_GEMMA), "pattern",
               doc="Gemma's RMSNorm scaling by (1 + w), without residual"),
    RegionKind("gemma_fused_add_rms_norm", programs.gemma_fused_add_rms_norm, (_H,), Form(_GEMMA, residual=True),
               "pattern", doc="residual add + Gemma's RMSNorm scaling by (1 + w), writing the sum as the next residual"),
    RegionKind("geglu", programs.geglu, (_H, _I), Form(projection=True, act=Op.GELU_TANH), "pattern",
               ("mlp.gate_up_proj", "mlp.act_fn"), "an MLP's gate_up projection + tanh-GELU*mul (Gemma's GeGLU)"),
    # the norm before it is post_attention_layernorm (Gemma) or pre_feedforward_layernorm (Gemma 2):
    # no module roles, the fusion pass serves it wherever capture finds it
    RegionKind("rmsnorm_geglu", programs.rmsnorm_geglu, (_H, _I), Form(_RMS, projection=True, act=Op.GELU_TANH),
               "pattern", doc="the residual add + RMSNorm before Gemma's MLP + gate_up projection + tanh-GELU*mul; "
                              "the add runs as one elementwise kernel before it, the rest as one kernel",
               add_beside=True),
    # the same regions on Gemma's norm where its float32 weight w + 1 is not of the activations' dtype
    # (bf16, fp16): the kernels take the stored weight and scale by 1 + w themselves
    RegionKind("gemma_rmsnorm_linear", programs.gemma_rmsnorm_linear, (_H, _O), Form(_GEMMA, projection=True),
               "pattern", _QKV, "a first layer's input Gemma RMSNorm (1 + w) + qkv projection"),
    RegionKind("gemma_fused_add_rmsnorm_linear", programs.gemma_fused_add_rmsnorm_linear, (_H, _O),
               Form(_GEMMA, residual=True, projection=True), "pattern", _QKV,
               "a layer's input residual add + Gemma RMSNorm (1 + w) + qkv projection; the kernel writes the "
               "residual"),
    RegionKind("gemma_rmsnorm_geglu", programs.gemma_rmsnorm_geglu, (_H, _I),
               Form(_GEMMA, projection=True, act=Op.GELU_TANH), "pattern",
               doc="rmsnorm_geglu on Gemma's norm (1 + w): the residual add beside the kernel, the rest as one",
               add_beside=True),
    # rotary embedding (vLLM's `rotary_embedding`, in place on q and k; NeoX or GPT-J style, full or partial
    # rotary_dim), and QK-norm + rotary (Qwen3, OLMo 2: the per-head RMSNorm of q and k before it, served by the
    # compiled-mode fusion pass only)
    RegionKind("rotary", programs.rotary, _ROT, Form(rotary=True), "custom_op",
               doc="rotary embedding of q and k by position, the cos/sin rows gathered from vLLM's cache",
               eager_classes=frozenset(ROTARY_CLASSES), vllm_op="rotary_embedding"),
    RegionKind("qk_norm_rotary", _qk_norm_rotary, _ROT, Form(_RMS, rotary=True), "pattern",
               doc="the per-head RMSNorm of q and of k (QK-norm), then rotary embedding"),
    # a mixture-of-experts layer's routed experts (vLLM's FusedMoE after its router), served where vLLM's
    # CPU experts class computes them, eagerly in both modes (the CPU build runs FusedMoE outside the graph)
    RegionKind("moe_experts", programs.moe_experts, _MOE, Form(act=Op.SILU, experts=True), "experts",
               doc="the routed experts' SiLU-gated MLPs, each token's top-k summed by its routing weights",
               vllm_op="fused_moe"),
    RegionKind("moe_experts_gelu_tanh", programs.moe_experts_gelu_tanh, _MOE, Form(act=Op.GELU_TANH, experts=True),
               "experts", doc="the routed experts' tanh-GELU-gated MLPs, summed by the routing weights",
               vllm_op="fused_moe"),
)})
_BY_FORM: Mapping[Form, RegionKind] = MappingProxyType({k.form: k for k in KINDS.values()})
assert len(_BY_FORM) == len(KINDS), "two kinds of one form"
# the op-level kinds (one of vLLM's norm or activation ops), the regions holding a projection, largest first,
# the rotary kinds (which the fusion pass matches on their own, `patch.rotary_match`) and the MoE experts
OP_KINDS = tuple(k for k in KINDS.values() if not (k.form.projection or k.form.rotary or k.form.experts))
EXPERT_KINDS = tuple(k for k in KINDS.values() if k.form.experts)
# the experts kind of each of vLLM's MoE activations (MoEActivation values) prism serves
EXPERTS_KIND_OF = MappingProxyType({MOE_ACTIVATIONS[k.form.act]: k for k in EXPERT_KINDS})
ROTARY_KINDS = tuple(k for k in KINDS.values() if k.form.rotary)
REGION_KINDS = tuple(sorted((k for k in KINDS.values() if k.form.projection), key=lambda k: k.rank))


def kind_of(form: Form) -> RegionKind | None:
    """The kind of this structure, or None where prism has none (e.g. Gemma's norm before a SiLU MLP)."""
    return _BY_FORM.get(form)


def hooked(hook: str) -> tuple[RegionKind, ...]:
    """The kinds the plugin serves through `hook` (one of HOOKS), in table order."""
    return tuple(k for k in KINDS.values() if k.hook == hook)


@dataclass(frozen=True)
class Site:
    """One captured region instance: its kind and the modules (paths) it spans."""

    kind: str
    modules: frozenset[str]


def servable(kind: str, modules: Iterable[str]) -> bool:
    """Whether a plugin hook serves this kind at these modules, by module role: the eager-mode class
    hooks' rule, which warmup and the doctor follow. In compiled mode the fusion pass serves a region
    wherever capture reports it (both use `patch.dataflow.find_regions`), whatever the roles."""
    k = KINDS.get(kind)
    if k is None:
        return False
    mods = [role_path(m) for m in modules]
    return not k.modules or (len(mods) == len(k.modules)
                             and all(m == role or m.endswith("." + role) for m, role in zip(mods, k.modules)))


def role_path(module: str) -> str:
    """A module path as its role reads: Dynamo names a module reached through a bound method
    (vLLM's Transformers backend) `mlp.forward.__self__.gate_up_proj`, in the role `mlp.gate_up_proj`."""
    return module.replace(".forward.__self__", "")


def owner(site: Site) -> str:
    """The module holding the site's modules (a decoder layer, an MLP), as the class hooks see it."""
    parts = [role_path(m).split(".") for m in site.modules]
    return ".".join(p[0] for p in zip(*parts) if len(set(p)) == 1)


def eager_served(site: Site, classes: Mapping[str, str]) -> bool:
    """Whether eager mode (no fusion pass) serves the site's kind there, given a kernel: an op-level
    kind wherever vLLM runs the op, a region of the "mlp" or "decoder_layer" hooks only where its
    owner's class (`classes`: module path -> class name, as capture records them) is one its hook
    patches, a "pattern" kind (Gemma's, the biased projections, QK-norm + rotary) never; rotary only in
    the rotary classes its replacement covers (`ROTARY_CLASSES`); the MoE experts wherever vLLM's CPU
    experts compute them."""
    k = KINDS.get(site.kind)
    if k is None or k.hook == "pattern":
        return False
    if k.hook in ("ir", "custom_op", "experts") and not k.eager_classes:
        return True
    return classes.get(owner(site)) in k.eager_classes


def served_sites(sites: Iterable[Site], failed: Iterable[Site] = (),
                 classes: Mapping[str, str] | None = None) -> dict[Site, Site | None]:
    """Each servable site -> None when the plugin would serve it with its own kernel, or the larger
    served site whose kernel runs it instead (a region takes in the ops it spans). Sites in `failed`
    have no kernel, so they take nothing in. Sites no hook serves are left out. With `classes`
    (module path -> class name), eager mode counts too: a site that eager mode serves and no larger
    region takes in there (`eager_served`) needs its own kernel, though compiled mode takes it in."""
    failed = set(failed)
    ok = [s for s in sites if servable(s.kind, sorted(s.modules, key=_order(s)))]
    out: dict[Site, Site | None] = {}
    for s in ok:
        cover = [o for o in ok if o not in failed and s.modules < o.modules]
        if classes is not None and eager_served(s, classes) and not any(eager_served(o, classes) for o in cover):
            cover = []
        out[s] = max(cover, key=lambda o: len(o.modules)) if cover else None
    return out


def _order(site: Site):
    """Module paths in the order the kind's roles list them (unknown ones last)."""
    roles = KINDS[site.kind].modules if site.kind in KINDS else ()

    def key(m: str) -> int:
        m = role_path(m)
        return next((i for i, r in enumerate(roles) if m == r or m.endswith("." + r)), len(roles))
    return key
