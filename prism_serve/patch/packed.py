"""The plain weights of the projections vLLM's CPU build packs (oneDNN, AMX): vLLM drops the plain
weight once packed, and what it packed is what the compiled graph holds, so the plugin records the
plain weight of each projection a region kernel serves, in the runtime (`Runtime.packed`,
`Runtime.packed_amx`), for the kernel to multiply with. Installed by `hooks.install` like the others.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from prism_serve.patch.runtime import Runtime
from prism_serve.patch.table import Table
from prism_serve.region_table import KINDS


def projection_shapes(table: Table) -> set[tuple]:
    """(dtype, out, in) of every projection weight some region kernel of the table multiplies with."""
    return {(dtype, *kind.projection_shape(dims)) for kind in KINDS.values() if kind.form.projection
            for dtype, dims, _ in table.ops.get(kind.name, {})}


def install(rt: Runtime, done) -> None:
    """Record the plain weight of each projection vLLM's CPU build packs whose shape a region kernel
    serves (vLLM then drops the plain weight; what it packed is what the compiled graph holds):
    under the oneDNN handle, for its oneDNN GEMM; under the packed tensor's data pointer, for its
    AMX GEMM, whose every packed weight is marked (a packed weight looks like a plain one). An
    entry goes with what it is keyed by."""
    try:
        from vllm import _custom_ops as vops
    except ImportError:
        return
    shapes = projection_shapes(rt.table)
    inner = getattr(vops, "create_onednn_mm", None)
    if shapes and inner is not None and not getattr(inner, "_prism", False):
        def create_onednn_mm(weight: Tensor, *args, **kwargs):
            handler = inner(weight, *args, **kwargs)
            plain = weight.t()  # vLLM packs the [in, out] transpose of the layer's [out, in] weight
            if (plain.dtype, *plain.shape) in shapes and plain.device.type == "cpu":
                key = int(handler.handler_tensor.item())
                rt.packed[key] = plain.detach()
                weakref.finalize(handler, rt.packed.pop, key, None)
            return handler

        create_onednn_mm._prism = True
        vops.create_onednn_mm = create_onednn_mm
        done.undo.append(lambda: setattr(vops, "create_onednn_mm", inner))
    install_amx(rt, shapes, done)


def install_amx(rt: Runtime, shapes: set[tuple], done) -> None:
    """Mark every weight vLLM packs for `_C.weight_packed_linear` (vLLM calls
    `torch.ops._C.convert_weight_packed` itself), with the plain weight where `shapes` has it."""
    namespace = torch.ops._C
    inner = getattr(namespace, "convert_weight_packed", None)
    if not shapes or inner is None or getattr(inner, "_prism", False):
        return

    def convert_weight_packed(weight: Tensor, *args, **kwargs):
        packed = inner(weight, *args, **kwargs)
        if packed.device.type == "cpu":
            key = packed.data_ptr()
            served = (weight.dtype, *weight.shape) in shapes and tuple(packed.shape) == tuple(weight.shape)
            rt.packed_amx[key] = weight.detach() if served else None
            weakref.finalize(packed, rt.packed_amx.pop, key, None)
        return packed

    convert_weight_packed._prism = True
    namespace.convert_weight_packed = convert_weight_packed
    done.undo.append(lambda: setattr(namespace, "convert_weight_packed", inner))
