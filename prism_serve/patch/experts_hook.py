"""The routed experts of vLLM's MoE layers: vLLM's CPU experts class runs `prism::moe_experts`
(or its GELU form) where the table has a kernel for the layer, in eager and compiled mode alike.

vLLM's `FusedMoE` computes the experts through a modular kernel whose experts object is, on the CPU
build, `CPUUnquantizedExperts` (or its x86 AMX / Arm / Power subclass, which differ in the layout
their `process_weights_after_loading` packs the stacked weights into). On the CPU the layer's
forward is traced into the compiled graph (vLLM calls its MoE forward directly there), so the
experts' `apply` runs inside the compiled model as well as in eager mode; patching the class's two
methods serves both:

- `process_weights_after_loading` records the layer's plain stacked weights (w13 [E, 2I, H],
  w2 [E, H, I], before vLLM pads and packs them) in the runtime, under the packed w13's data pointer,
  where the table holds a kernel for the layer's (dtype, experts, top-k, hidden, intermediate); the
  instance then remembers which prism op serves it.
- `apply` of such an instance runs that op (opaque to torch.compile) and copies its output into
  vLLM's; the op's miss (a token count out of the table's buckets, a failed kernel) runs vLLM's own
  `cpu_fused_moe` on the packed weights, with the instance's instruction set. Every other call
  (zentorch, biases, expert parallelism, the router weight applied on the input, another
  activation) runs vLLM's own `apply`.

This keeps vLLM's weight layout, routing and prepare/finalize; the price is a second copy of the
served layers' expert weights, as for the projections vLLM packs (`packed`).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from prism_serve.patch import ops
from prism_serve.patch.runtime import PackedExperts, Runtime
from prism_serve.region_table import EXPERT_KINDS, EXPERTS_KIND_OF, MOE_ACTIVATIONS, RegionKind

# `FusedMoEExpertsModular.apply`'s arguments after self, in order
APPLY_ARGS = ("output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation", "global_num_experts",
              "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2", "expert_tokens_meta",
              "apply_router_weight_on_input")


def cpu_experts_class():
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not vLLM's CPU build, or a vLLM without it
        return None
    return CPUUnquantizedExperts


def vllm_cpu_experts(rt: Runtime, kind: RegionKind):
    """vLLM's CPU fused MoE on the packed weights vLLM holds (the experts kinds' fallback); on weights
    nothing packed, the torch reference."""
    activation, reference = MOE_ACTIVATIONS[kind.form.act], ops.ref_moe_experts(kind.form.act)

    def run(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        if w13.data_ptr() not in rt.experts:
            return reference(x, topk_weights, topk_ids, w13, w2)
        from vllm import _custom_ops as vops

        out = torch.empty_like(x)
        vops.cpu_fused_moe(out, x, w13, w2, None, None, topk_weights, topk_ids, activation, rt.experts[w13.data_ptr()].isa)
        return out
    return run


def served_kind(rt: Runtime, moe_config, w13: Tensor, w2: Tensor):
    """The experts kind whose table entry serves a layer with these plain weights, or None."""
    kind = EXPERTS_KIND_OF.get(getattr(moe_config.activation, "value", None))
    table, dims = rt.table, ops.experts_dims(w13, w2, moe_config.experts_per_token)
    if kind is None or table is None or dims is None or w13.device.type != table.device:
        return None
    return kind if table.entry(kind.name, w13.dtype, dims, None) is not None else None


def install(rt: Runtime, done) -> None:
    """Patch vLLM's CPU experts class (and so its subclasses) where the table holds an experts kernel."""
    cls = cpu_experts_class()
    if cls is None or rt.table is None or not any(rt.table.ops.get(k.name) for k in EXPERT_KINDS):
        return
    if getattr(cls.apply, "_prism", False):
        return
    inner_load, inner_apply = cls.process_weights_after_loading, cls.apply
    for kind in EXPERT_KINDS:
        rt.fallbacks[kind.name] = vllm_cpu_experts(rt, kind)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        inner_load(self, layer)
        kind = None
        if not getattr(self, "_use_zentorch", False) and getattr(layer, "w13_bias", None) is None:
            kind = served_kind(rt, self.moe_config, w13, w2)
        self._prism_kind = kind
        if kind is not None:  # the record goes with the packed weight it is keyed by
            key = layer.w13_weight.data_ptr()
            rt.experts[key] = PackedExperts(w13, w2, self.isa)
            weakref.finalize(layer.w13_weight, rt.experts.pop, key, None)

    def apply(self, *args, **kwargs):
        a = dict(zip(APPLY_ARGS, args)) | kwargs  # vLLM's modular kernel passes them by name
        kind = getattr(self, "_prism_kind", None)
        if (kind is None or a["expert_map"] is not None or a["apply_router_weight_on_input"]
                or MOE_ACTIVATIONS[kind.form.act] != getattr(a["activation"], "value", a["activation"])):
            return inner_apply(self, *args, **kwargs)
        y = getattr(torch.ops.prism, kind.name)(a["hidden_states"], a["topk_weights"], a["topk_ids"], a["w1"], a["w2"])
        a["output"].copy_(y)
        return None

    process_weights_after_loading._prism = apply._prism = True
    cls.process_weights_after_loading, cls.apply = process_weights_after_loading, apply

    def undo() -> None:
        cls.process_weights_after_loading, cls.apply = inner_load, inner_apply
    done.undo.append(undo)
