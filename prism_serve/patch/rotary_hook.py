"""Eager mode's rotary embedding: vLLM's rotary classes replaced through `CustomOp.register_oot`,
as `SiluAndMul` is (see `hooks`), each instance running `prism::rotary` where the table has a kernel
for its call.

vLLM's rotary (`RotaryEmbedding.forward_cpu` / `forward_cuda`: its `_C.rotary_embedding` kernel)
rotates q and k in place and returns them; the replacement keeps that: the prism op returns the
rotated q and k (a functional op, opaque to torch.compile), which are copied into the caller's q
and k. A call no kernel serves (another dtype or size, no key, positions out of the table's
buckets: the op's own miss) runs vLLM's own forward, the one its CustomOp dispatch would have
chosen. Only exactly the classes of `region_table.ROTARY_CLASSES` are replaced (their forward is
RotaryEmbedding's; they differ in the cos/sin cache, an input of the kernel). A model built under
a config that carries the fusion pass (compiled mode) keeps vLLM's forward: the pass then matches
the rotary chain in the compiled graph (with the QK-norm before it, see `rotary_match`).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from prism_serve.patch import fusion
from prism_serve.patch.ops import ROTARY, rotary_key
from prism_serve.patch.runtime import Runtime
from prism_serve.region_table import ROTARY_CLASSES

FORWARDS = ("forward_native", "forward_cuda", "forward_cpu", "forward_xpu", "forward_hip", "forward_oot")


def vllm_rotary(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, head_size: int,
                is_neox: bool) -> tuple[Tensor, Tensor]:
    """vLLM's rotary kernel (`_C.rotary_embedding`, in place) on copies of q and k: the prism ops' miss."""
    from vllm import _custom_ops as vops

    q, k = q.clone(), k.clone()
    vops.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    return q, k


def _vllm_forward(vllm_cls):
    """The forward vLLM's CustomOp dispatch picks for `vllm_cls` on this platform (its kernel where its
    custom op is enabled, else its torch body)."""
    from vllm.platforms import current_platform

    if not vllm_cls.enabled():
        return vllm_cls.forward_native
    return getattr(vllm_cls, f"forward_{current_platform.device_type}", vllm_cls.forward_native)


def _replacement(rt: Runtime, vllm_cls) -> type:
    """A subclass of `vllm_cls` whose every forward runs `prism::rotary` where the table serves the call."""
    op = getattr(torch.ops.prism, ROTARY.name)

    def __init__(self, *args, **kwargs):
        vllm_cls.__init__(self, *args, **kwargs)
        self._prism_vllm_forward = _vllm_forward(vllm_cls)
        self._prism_on = not fusion.in_current_config()  # compiled mode: the fusion pass serves it

    def forward(self, positions: Tensor, query: Tensor, key: Tensor | None = None):
        if self._prism_on and key is not None:
            cache = self._match_cos_sin_cache_dtype(query)
            dims = rotary_key(positions, query, key, cache, self.head_size, self.is_neox_style)
            table = rt.table
            if (dims is not None and table is not None and query.device.type == table.device
                    and table.entry(ROTARY.name, query.dtype, dims) is not None):
                q, k = op(positions, query, key, cache, self.head_size, self.is_neox_style)
                query.copy_(q)
                key.copy_(k)
                return query, key
        return self._prism_vllm_forward(self, positions, query, key)

    name = f"Prism{vllm_cls.__name__}"
    return type(name, (vllm_cls,), {"_prism": True, "__init__": __init__, "__qualname__": name,
                                    **dict.fromkeys(FORWARDS, forward)})


def _forget_built_ropes() -> None:
    """Drop the rotary instances vLLM built before the switch (to or from prism's): `get_rope` builds each
    configuration once and keeps it (`_ROPE_DICT`), so a model built after the switch would get the
    instance built before it."""
    from vllm.model_executor.layers import rotary_embedding

    built = getattr(rotary_embedding, "_ROPE_DICT", None)
    if isinstance(built, dict):
        for key in [k for k, rope in built.items() if type(rope).__name__.removeprefix("Prism") in ROTARY_CLASSES]:
            del built[key]


def install(rt: Runtime, done) -> None:
    """Replace each of vLLM's rotary classes (`ROTARY_CLASSES`) where the table has rotary kernels;
    one another plugin replaced first is left alone (hooks.Installed `done` records names and undos)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if not rt.table.ops.get(ROTARY.name):
        return
    for name, module in ROTARY_CLASSES.items():
        vllm_cls = getattr(importlib.import_module(module), name, None)
        if vllm_cls is None:
            continue
        if name in op_registry_oot:
            if getattr(op_registry_oot[name], "_prism", False):
                done.names.append(name)
                done.kinds.add(ROTARY.name)
            continue
        vllm_cls.register_oot(_replacement(rt, vllm_cls), name=name)
        done.undo.append(lambda n=name: (op_registry_oot.pop(n, None), _forget_built_ropes()))
        done.names.append(name)
        done.kinds.add(ROTARY.name)
    _forget_built_ropes()
