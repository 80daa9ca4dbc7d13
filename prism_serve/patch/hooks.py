"""How prism's ops reach vLLM: a declarative list of hooks, each installed once and undoable.

- vLLM IR providers named "prism" for `rms_norm` and `fused_add_rms_norm`, put first in the
  platform's default IR op priority (a priority the user set explicitly still comes first);
  under torch.compile vLLM's IR lowering pass traces the provider into the graph as the opaque
  `prism::` op.
- `CustomOp.register_oot` replacement of `SiluAndMul`, whose every forward runs `prism::silu_and_mul`,
  and of `GeluAndMul`, whose tanh form (Gemma's GeGLU) runs `prism::gelu_tanh_and_mul`; and of vLLM's
  rotary classes in eager mode (`rotary_hook`), running `prism::rotary`.
- In compiled mode, the fusion pass (`fusion.py`), which vLLM's config carries into Inductor:
  every region kind matched by FX pattern on the model's graph and replaced by its `prism::` op
  where the table has a kernel, whatever the architecture. On the CPU build vLLM packs projection
  weights for oneDNN and drops them; `packed.install` records the plain weight of each projection
  whose shape a region kernel serves, under vLLM's oneDNN handle, which is what the graph holds.
- vLLM's CPU experts class (`experts_hook`), in both modes: the routed experts of each MoE layer the
  table has a kernel for run `prism::moe_experts` (or its GELU form) on the plain stacked weights.
- In eager mode (`enforce_eager`, where no pass runs) only: whole regions, by class, patched in
  place on instances of exactly the classes named (the region table's `eager_classes`). The
  decoder MLPs of Llama and Qwen2/3 (`LlamaMLP`, `Qwen2MLP`, whatever model builds them) run
  their gate_up projection and activation as one `prism::swiglu` kernel where the table has one for that layer; and in
  Llama, Mistral and Qwen3 decoder layers, the input side (residual add, RMSNorm, qkv
  projection) as one `prism::fused_add_rmsnorm_linear` or `prism::rmsnorm_linear`, and the
  post-attention side (RMSNorm of the residual sum, gate_up projection, SiLU*mul) as one
  `prism::rmsnorm_swiglu`. A model built under a config that carries the fusion pass keeps
  vLLM's forwards.

Each provider's `supports_args` accepts only calls the table has kernels for (dtype, size,
epsilon, device); inside the op a num_tokens miss runs the next provider in vLLM's priority.
"""


import functools
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from prism_serve.optimize.ir.ops import Op
from prism_serve.patch import experts_hook, fusion, ops, packed, rotary_hook
from prism_serve.patch.runtime import Runtime
from prism_serve.patch.table import Table
from prism_serve.region_table import MODEL_CLASSES, Form, hooked, kind_of

PROVIDER = "prism"
# the kinds served as vLLM IR providers (their names are vLLM's IR ops), by whether they add a residual
IR_KINDS = MappingProxyType({k.form.residual: k for k in hooked("ir")})
# the activation kinds served by CustomOp replacement
SILU, GELU_TANH = kind_of(Form(act=Op.SILU)), kind_of(Form(act=Op.GELU_TANH))
# the whole regions of eager mode: an MLP's (hook "mlp"), a decoder layer's input side (by whether its
# norm adds the residual) and its post-attention side (hook "decoder_layer")
(MLP_KIND,) = hooked("mlp")
INPUT_SIDE = MappingProxyType({k.form.residual: k for k in hooked("decoder_layer") if not k.form.act})
(POST_SIDE,) = (k for k in hooked("decoder_layer") if k.form.act)


@dataclass
class Installed:
    """What was hooked, and how to undo it; `runtime` is the state every hook was handed (the undo
    closes it last)."""

    names: list[str]
    undo: list[Callable[[], None]]
    kinds: set[str] = field(default_factory=set)  # the region kinds whose kernels a hook now serves
    runtime: Runtime | None = None

    def revert(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
        self.names.clear()
        self.kinds.clear()


# --- the IR providers: same signature and defaults as vLLM's native impls ------------------

def _served(rt: Runtime, kind: str, x: Tensor, dim: int, eps: float | None) -> bool:
    table = rt.table
    return table is not None and x.device.type == table.device and table.entry(kind, x.dtype, dim, eps) is not None


def _supports(rt: Runtime) -> dict[bool, Callable]:
    """The IR providers' supports_args for `rt`, by whether the op adds a residual (vLLM checks that
    their parameters are its native impls')."""
    def rms_norm_supports(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
        return (variance_size is None and weight is not None and weight.dtype == x.dtype
                and _served(rt, IR_KINDS[False].name, x, x.shape[-1], epsilon))

    def fused_add_rms_norm_supports(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                                    variance_size: int | None = None) -> bool:
        return (variance_size is None and weight is not None and weight.dtype == x.dtype
                and x_residual.dtype == x.dtype and _served(rt, IR_KINDS[True].name, x, x.shape[-1], epsilon))
    return {False: rms_norm_supports, True: fused_add_rms_norm_supports}


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return torch.ops.prism.rms_norm(x, weight, epsilon)


def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    return torch.ops.prism.fused_add_rms_norm(x, x_residual, weight, epsilon)


# the vLLM IR provider (same signature and defaults as vLLM's native impl), by whether the op adds a residual
IMPLS = MappingProxyType({False: rms_norm, True: fused_add_rms_norm})


def _next_provider(ir_op) -> Callable:
    """A fallback that runs the provider vLLM would choose without prism (functionally): the first
    in its priority that supports the call (one above prism never sends the call here), else native."""
    def run(*args):
        for impl in ir_op._priority_impls:
            if impl.provider != PROVIDER and impl.supports_args(*args):
                return impl.func_impl_fn(*args)
        return ir_op.impls["native"].impl_fn(*args)
    return run


def _vllm_activation(kind: str, native: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """vLLM's own path for an activation: its `_C.<kind>` kernel on CUDA / XPU, else `native`."""
    from vllm.platforms import current_platform

    if (current_platform.is_cuda_alike() or current_platform.is_xpu()) and hasattr(torch.ops._C, kind):
        def vllm_kernel(x: Tensor) -> Tensor:
            out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
            getattr(torch.ops._C, kind)(out, x)
            return out
        return vllm_kernel
    return native


def _install_fallbacks(rt: Runtime, done: Installed) -> None:
    """Where the table serves anything, every miss of every prism op runs vLLM's own path, also for
    kinds the table does not serve (a region the fusion pass formed falls back through its norm
    and activation; layer 0 of a decoder patched for the residual form falls back through
    rmsnorm_linear); the torch references in `ops` are left for runs without vLLM."""
    if not any(rt.table.ops.values()):
        return
    from vllm import ir
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    saved = dict(rt.fallbacks)
    done.undo.append(lambda: (rt.fallbacks.clear(), rt.fallbacks.update(saved)))
    for kind in IR_KINDS.values():
        rt.fallbacks[kind.name] = _next_provider(getattr(ir.ops, kind.name))
    rt.fallbacks[SILU.name] = _vllm_activation(SILU.name, SiluAndMul.forward_native)
    tanh = functools.partial(GeluAndMul.forward_native, types.SimpleNamespace(approximate="tanh"))
    rt.fallbacks[GELU_TANH.name] = _vllm_activation(GELU_TANH.name, tanh)
    rt.fallbacks[MLP_KIND.name] = functools.partial(_vllm_swiglu, rt)
    rt.fallbacks.update({name: functools.partial(fn, rt) for name, fn in LAYER_FALLBACKS.items()})
    rt.fallbacks[ops.ROTARY.name] = rotary_hook.vllm_rotary


def _install_ir(rt: Runtime, done: Installed) -> None:
    """The IR providers for the kinds `rt`'s table serves (one a revert left behind is replaced, so its
    supports_args read this runtime's table)."""
    from vllm import ir
    from vllm.platforms import current_platform

    kinds = [k for k in IR_KINDS.values() if rt.table.ops.get(k.name)]
    served = [k.name for k in kinds]  # vLLM's IR op names
    if not served:
        return
    supports = _supports(rt)
    for kind in kinds:
        ir_op = getattr(ir.ops, kind.name)
        ir_op.impls.pop(PROVIDER, None)
        ir_op.register_impl(PROVIDER, supported=True, supports_args=supports[kind.form.residual])(
            IMPLS[kind.form.residual])
        done.undo.append(lambda o=ir_op: o.impls.pop(PROVIDER, None))
    cls = type(current_platform)
    original = cls.__dict__.get("get_default_ir_op_priority")
    if getattr(cls.get_default_ir_op_priority, "_prism", False):
        done.names += [f"vllm.ir.{op}" for op in served]
        done.kinds.update(served)
        return
    inner = cls.get_default_ir_op_priority

    def get_default_ir_op_priority(_cls, vllm_config):
        priority = inner(vllm_config)
        for op in served:
            current = getattr(priority, op)
            if PROVIDER not in current:
                current.insert(0, PROVIDER)
        return priority

    get_default_ir_op_priority._prism = True
    cls.get_default_ir_op_priority = classmethod(get_default_ir_op_priority)

    def undo() -> None:
        if original is None:
            delattr(cls, "get_default_ir_op_priority")
        else:
            cls.get_default_ir_op_priority = original
    done.undo.append(undo)
    done.names += [f"vllm.ir.{op}" for op in served]
    done.kinds.update(served)


# --- SiluAndMul and GeluAndMul through CustomOp.register_oot ---------------------------------

def _install_activation(table: Table, done: Installed, cls, kind: str, forward: Callable) -> None:
    """Replace vLLM's activation class `cls` by a subclass whose every path runs `forward(self, x)`,
    where the table has kernels for `kind` (`prism::<kind>` inside; its miss runs vLLM's own path,
    see `_install_fallbacks`). Left alone where another plugin replaced `cls` first."""
    from vllm.model_executor.custom_op import op_registry_oot

    name = cls.__name__
    if not table.ops.get(kind):
        return
    if name in op_registry_oot:
        if getattr(op_registry_oot[name], "_prism", False):
            done.names.append(name)
            done.kinds.add(kind)
        return  # another plugin replaced it first: leave theirs in place

    class Prism(cls):
        _prism = True
        forward_native = forward_cuda = forward_cpu = forward_xpu = forward_hip = forward_oot = forward

    Prism.__name__ = Prism.__qualname__ = f"Prism{name}"
    cls.register_oot(Prism, name=name)
    _forget_built_activations(name)
    done.undo.append(lambda: (op_registry_oot.pop(name, None), _forget_built_activations(name)))
    done.names.append(name)
    done.kinds.add(kind)


def _install_silu(rt: Runtime, done: Installed) -> None:
    """`SiluAndMul`: every instance runs `prism::silu_and_mul`."""
    from vllm.model_executor.layers.activation import SiluAndMul

    def forward(self, x: Tensor) -> Tensor:
        return silu(x)
    silu = getattr(torch.ops.prism, SILU.name)
    _install_activation(rt.table, done, SiluAndMul, SILU.name, forward)


def _install_gelu(rt: Runtime, done: Installed) -> None:
    """`GeluAndMul`: an instance with approximate="tanh" (Gemma's GeGLU) runs
    `prism::gelu_tanh_and_mul`; one with exact GELU keeps vLLM's path (no kind serves it)."""
    from vllm.model_executor.layers.activation import GeluAndMul

    def forward(self, x: Tensor) -> Tensor:
        if self.approximate == "tanh":
            return gelu_tanh(x)
        # vLLM's path: its kernel where it built one (CUDA, XPU, POWER), else torch
        return GeluAndMul.forward_cuda(self, x) if hasattr(self, "op") else GeluAndMul.forward_native(self, x)
    gelu_tanh = getattr(torch.ops.prism, GELU_TANH.name)
    _install_activation(rt.table, done, GeluAndMul, GELU_TANH.name, forward)


def _forget_built_activations(cls_name: str) -> None:
    """Drop the instances of activation class `cls_name` vLLM built before the switch (to or from
    prism's). vLLM builds each named activation once and keeps it (`activation.get_act_and_mul_fn`,
    which its Transformers backend uses, OLMo 2's among others), and some models cache the one they
    build (Gemma's `_get_gemma_act_fn`): without this, a model built after the switch would get the
    instance built before it."""
    import sys

    from vllm.model_executor.layers import activation

    built = getattr(getattr(activation, "_ACTIVATION_AND_MUL_REGISTRY", None), "_dict", None)
    if isinstance(built, dict):
        for name in [n for n, op in built.items() if isinstance(op, getattr(activation, cls_name))]:
            del built[name]
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.model_executor.models.") and module is not None:
            for attr, fn in list(vars(module).items()):
                if attr.endswith("act_fn") and callable(getattr(fn, "cache_clear", None)):
                    fn.cache_clear()


# --- whole region: a SwiGLU MLP's gate_up projection + SiLU*mul as one prism::swiglu ----------

# (model module, class name): decoder MLPs whose forward runs gate_up_proj -> act_fn -> down_proj.
# Patched in place, so every model that builds one is served, however it imported the class
# (qwen3's Qwen3MLP is Qwen2MLP, GLM-4 builds LlamaMLP); only instances of exactly these classes
REGIONS = tuple((MODEL_CLASSES[c], c) for c in sorted(MLP_KIND.eager_classes))


def _swiglu_served(rt: Runtime, mlp) -> bool:
    """A plain gate_up projection (see `_plain_linear`) the table has a kernel for."""
    g = mlp.gate_up_proj
    return _plain_linear(g) and _has(rt, MLP_KIND.name, g.weight, (g.weight.shape[1], g.weight.shape[0] // 2), None)


def _keep_weight(owner, linear, attr: str) -> None:
    """Hold `linear`'s weight as buffer `attr` of `owner` once loaded: on the CPU vLLM packs it for
    its own GEMM and drops the plain tensor (elsewhere the buffer is the same storage, no extra memory)."""
    qm = linear.quant_method
    inner = qm.process_weights_after_loading

    def process_weights_after_loading(layer):
        plain = layer.weight.detach() if layer is linear else None
        inner(layer)
        if layer is linear:
            setattr(owner, attr, layer.weight.detach() if layer.weight.numel() else plain)

    qm.process_weights_after_loading = process_weights_after_loading


def _attach_mlp(rt: Runtime, mlp) -> None:
    """Serve this MLP's gate_up projection and activation as one prism::swiglu kernel where the table
    has one (eager mode; a model built under the fusion pass keeps vLLM's forward)."""
    mlp.register_buffer("_prism_weight", None, persistent=False)
    try:
        served = not fusion.in_current_config() and _swiglu_served(rt, mlp)
    except Exception:  # noqa: BLE001 - an unexpected layer layout: vLLM's own forward
        served = False
    if served:
        mlp._prism_site, mlp._prism_gate_up_cls = len(rt.sites), type(mlp.gate_up_proj)  # LoRA swaps it: stand down
        rt.sites.append(weakref.ref(mlp))
        _keep_weight(mlp, mlp.gate_up_proj, "_prism_weight")


def _patch_in_place(cls, attach, forward=None) -> Callable[[], None]:
    """Run `attach(instance)` at the end of `cls.__init__` for instances of exactly `cls` (a subclass
    may rewire what its forward sends where: Aria's decoder layer swaps the MLP for experts after
    calling this init), and replace `cls.forward` by `forward(original)` if given; returns the undo."""
    own = {name: cls.__dict__[name] for name in ("__init__", "forward") if name in cls.__dict__}
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is cls:
            attach(self)

    cls.__init__, cls._prism_init = __init__, init
    if forward is not None:
        cls.forward = forward(cls.forward)

    def undo():
        for name in ("__init__", "forward", "_prism_init"):
            if name in own:
                setattr(cls, name, own[name])
            elif name in cls.__dict__:
                delattr(cls, name)
    return undo


def _swiglu_forward(original):
    def forward(self, x):
        if getattr(self, "_prism_weight", None) is None or type(self.gate_up_proj) is not self._prism_gate_up_cls:
            return original(self, x)
        y = getattr(torch.ops.prism, MLP_KIND.name)(x, self._prism_weight, self._prism_site)
        out, _ = self.down_proj(y)
        return out
    return forward


def _vllm_swiglu(rt: Runtime, x: Tensor, w_gate_up: Tensor, site: int) -> Tensor:
    """vLLM's own path for a patched MLP: its gate_up projection, then its activation."""
    mlp = rt.sites[site]() if 0 <= site < len(rt.sites) else None
    if mlp is None:
        return ops.reference(MLP_KIND.name)(x, w_gate_up, site)
    gate_up, _ = mlp.gate_up_proj(x)
    return mlp.act_fn(gate_up)


def _model_classes(names):
    """(module, class name, class) for each (module name, class name) this vLLM has."""
    import importlib

    for module_name, cls_name in names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, cls_name, None)
        if cls is not None:
            yield module, cls_name, cls


def _install_regions(rt: Runtime, done: Installed) -> None:
    if not rt.table.ops.get(MLP_KIND.name):
        return
    for _, cls_name, cls in _model_classes(REGIONS):
        if "_prism_init" in cls.__dict__:
            continue
        done.undo.append(_patch_in_place(cls, functools.partial(_attach_mlp, rt), _swiglu_forward))
        done.names.append(f"{cls_name} ({MLP_KIND.name} region) in eager mode")
        done.kinds.add(MLP_KIND.name)


# --- whole regions in a decoder layer: its input side and its post-attention side ------------
#
# Input side: the layer's input_layernorm runs the norm *and* the qkv projection as one kernel,
# `prism::rmsnorm_linear` (no residual yet) or `prism::fused_add_rmsnorm_linear` (the kernel adds
# the residual and writes the sum, the next residual), and its qkv_proj passes that output on.
# Post-attention side: post_attention_layernorm adds the residual and runs the norm, gate_up
# projection and SiLU*mul as one `prism::rmsnorm_swiglu`; its MLP then runs down_proj only.
# Each pair is switched per instance, together, and only where the layer's forward sends the
# norm's output to that module alone, so the pair stays exact: instances of exactly these classes
# (Llama's, Mistral's, Qwen3's), not of a subclass, whose forward or modules may differ; Mistral's
# only without its time-conditioned scale between the post-attention norm and the MLP.

DECODER_LAYERS = tuple((MODEL_CLASSES[c], c) for c in sorted(POST_SIDE.eager_classes.union(
    *(k.eager_classes for k in INPUT_SIDE.values()))))
# per class: instances whose forward puts something between a norm and its module (left alone)
REWIRED = MappingProxyType({"MistralDecoderLayer": lambda layer: getattr(layer, "ada_rms_norm_t_cond", None) is not None})


def _plain_linear(linear) -> bool:
    """An unquantized, unsharded, bias-free projection with a 2-D weight."""
    return (type(linear.quant_method).__name__ == "UnquantizedLinearMethod" and getattr(linear, "bias", None) is None
            and getattr(linear, "tp_size", 1) == 1 and linear.weight.dim() == 2)


def _plain_norm(norm) -> bool:
    return getattr(norm, "has_weight", False) and getattr(norm, "variance_size_override", None) is None


def _has(rt: Runtime, kind: str, weight: Tensor, dims: tuple, eps: float) -> bool:
    table = rt.table
    return table is not None and table.entry(kind, weight.dtype, dims, eps) is not None


def _attach_input_side(rt: Runtime, layer, site: int) -> None:
    norm, qkv = layer.input_layernorm, layer.self_attn.qkv_proj
    if not (_plain_norm(norm) and _plain_linear(qkv)):
        return
    eps, dims = norm.variance_epsilon, (qkv.weight.shape[1], qkv.weight.shape[0])
    plain, fused = (_has(rt, INPUT_SIDE[residual].name, qkv.weight, dims, eps) for residual in (False, True))
    plain_op, fused_op = (getattr(torch.ops.prism, INPUT_SIDE[residual].name) for residual in (False, True))
    if not (plain or fused):
        return
    qkv_cls = type(qkv)
    layer.register_buffer("_prism_qkv_weight", None, persistent=False)
    _keep_weight(layer, qkv, "_prism_qkv_weight")
    norm_forward, qkv_forward = norm.forward, qkv.forward
    layer._prism_originals.update(norm=norm_forward, qkv=qkv_forward)

    def active() -> bool:  # weights loaded, and no LoRA layer swapped in since
        return layer._prism_qkv_weight is not None and type(layer.self_attn.qkv_proj) is qkv_cls

    def norm_and_project(x, residual=None):
        if not active():
            return norm_forward(x) if residual is None else norm_forward(x, residual)
        w = layer._prism_qkv_weight
        if residual is None:
            return plain_op(x, norm.weight, w, eps, site)
        if fused:
            return fused_op(x, residual, norm.weight, w, eps, site)
        s = x + residual
        return plain_op(s, norm.weight, w, eps, site), s

    def projected(x):  # the layer's input norm already projected it
        return (x, None) if active() else qkv_forward(x)

    norm.forward, qkv.forward = norm_and_project, projected


def _attach_post_side(rt: Runtime, layer, site: int) -> None:
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    gate_up = getattr(mlp, "gate_up_proj", None)
    if gate_up is None or not hasattr(mlp, "down_proj") or not (_plain_norm(norm) and _plain_linear(gate_up)):
        return
    eps, dims = norm.variance_epsilon, (gate_up.weight.shape[1], gate_up.weight.shape[0] // 2)
    if not _has(rt, POST_SIDE.name, gate_up.weight, dims, eps):
        return
    post_op = getattr(torch.ops.prism, POST_SIDE.name)
    gate_up_cls = type(gate_up)
    layer.register_buffer("_prism_gate_up_weight", None, persistent=False)
    _keep_weight(layer, gate_up, "_prism_gate_up_weight")
    norm_forward, mlp_forward = norm.forward, mlp.forward
    layer._prism_originals.update(post_norm=norm_forward, gate_up=gate_up.forward, act=mlp.act_fn)

    def active() -> bool:
        return layer._prism_gate_up_weight is not None and type(layer.mlp.gate_up_proj) is gate_up_cls

    def add_norm_and_mlp_in(x, residual=None):
        if residual is None or not active():
            return norm_forward(x) if residual is None else norm_forward(x, residual)
        s = x + residual
        return post_op(s, norm.weight, layer._prism_gate_up_weight, eps, site), s

    def down_only(x):  # the post-attention norm already ran gate_up and the activation
        return mlp.down_proj(x)[0] if active() else mlp_forward(x)

    norm.forward, mlp.forward = add_norm_and_mlp_in, down_only


def _attach_decoder_layer(rt: Runtime, layer) -> None:
    site = len(rt.layer_sites)
    layer._prism_originals = {}
    if fusion.in_current_config():  # compiled mode: the fusion pass serves this layer's regions
        return
    if REWIRED.get(type(layer).__name__, lambda _: False)(layer):
        return
    for attach in (_attach_input_side, _attach_post_side):
        try:
            attach(rt, layer, site)
        except Exception:  # noqa: BLE001 - an unexpected layer layout: vLLM's own forward
            continue
    if layer._prism_originals:
        rt.layer_sites.append(weakref.ref(layer))


def _site(rt: Runtime, site: int):
    layer = rt.layer_sites[site]() if 0 <= site < len(rt.layer_sites) else None
    return layer._prism_originals if layer is not None else None


def _vllm_rmsnorm_linear(rt: Runtime, x: Tensor, norm_weight: Tensor, weight: Tensor, epsilon: float,
                         site: int) -> Tensor:
    """vLLM's own path for a patched layer's input side: its input norm, then its qkv projection."""
    orig = _site(rt, site)
    if orig is None or "norm" not in orig:
        return ops.reference(INPUT_SIDE[False].name)(x, norm_weight, weight, epsilon, site)
    return orig["qkv"](orig["norm"](x))[0]


def _vllm_fused_add_rmsnorm_linear(rt: Runtime, x: Tensor, residual: Tensor, norm_weight: Tensor, weight: Tensor,
                                   epsilon: float, site: int) -> tuple[Tensor, Tensor]:
    """vLLM's own path: its input norm's residual add and norm, then its qkv projection."""
    orig = _site(rt, site)
    if orig is None or "norm" not in orig:
        return ops.reference(INPUT_SIDE[True].name)(x, residual, norm_weight, weight, epsilon, site)
    y, r = orig["norm"](x, residual)
    return orig["qkv"](y)[0], r


def _vllm_rmsnorm_swiglu(rt: Runtime, x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, epsilon: float,
                         site: int) -> Tensor:
    """vLLM's own path on the residual sum: its post-attention norm, gate_up projection, activation."""
    orig = _site(rt, site)
    if orig is None or "post_norm" not in orig:
        return ops.reference(POST_SIDE.name)(x, norm_weight, w_gate_up, epsilon, site)
    gate_up, _ = orig["gate_up"](orig["post_norm"](x))
    return orig["act"](gate_up)


LAYER_FALLBACKS = MappingProxyType({INPUT_SIDE[False].name: _vllm_rmsnorm_linear,
                                    INPUT_SIDE[True].name: _vllm_fused_add_rmsnorm_linear,
                                    POST_SIDE.name: _vllm_rmsnorm_swiglu})


def _install_decoder_layers(rt: Runtime, done: Installed) -> None:
    served = [kind for kind in LAYER_FALLBACKS if rt.table.ops.get(kind)]
    if not served:
        return
    for _, cls_name, cls in _model_classes(DECODER_LAYERS):
        if "_prism_init" in cls.__dict__:
            continue
        # patched in place: models take their layer class as a default argument bound at import
        done.undo.append(_patch_in_place(cls, functools.partial(_attach_decoder_layer, rt)))
        done.names.append(f"{cls_name} ({', '.join(served)}) in eager mode")
        done.kinds.update(served)


HOOKS = (_install_fallbacks, _install_ir, _install_silu, _install_gelu, rotary_hook.install, _install_regions,
         _install_decoder_layers, packed.install, experts_hook.install, fusion.install)


def install(table: Table) -> Installed:
    """Open a runtime for `table` (the prism ops now run its kernels) and hook every op it serves
    into vLLM; every hook is handed that runtime."""
    rt = ops.open_runtime(table)
    done = Installed([], [rt.close], runtime=rt)
    try:
        for hook in HOOKS:
            hook(rt, done)
    except BaseException:
        done.revert()
        raise
    return done
