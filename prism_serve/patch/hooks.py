"""How prism's ops reach vLLM: a declarative list of hooks, each installed once and undoable.

- vLLM IR providers named "prism" for `rms_norm` and `fused_add_rms_norm`, put first in the
  platform's default IR op priority (a priority the user set explicitly still comes first);
  under torch.compile vLLM's IR lowering pass traces the provider into the graph as the opaque
  `prism::` op.
- `CustomOp.register_oot` replacement of `SiluAndMul`, whose every forward runs `prism::silu_and_mul`.

Each provider's `supports_args` accepts only calls the table has kernels for (dtype, size,
epsilon, device); inside the op a num_tokens miss runs the next provider in vLLM's priority.
"""


from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from prism_serve.patch import ops
from prism_serve.patch.table import Table

PROVIDER = "prism"
IR_OPS = ("rms_norm", "fused_add_rms_norm")


@dataclass
class Installed:
    """What was hooked, and how to undo it."""

    names: list[str]
    undo: list[Callable[[], None]]

    def revert(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
        self.names.clear()


# --- the IR providers: same signature and defaults as vLLM's native impls ------------------

def _served(op: str, x: Tensor, dim: int, eps: float | None) -> bool:
    table = ops.STATE.table
    return table is not None and x.device.type == table.device and table.entry(op, x.dtype, dim, eps) is not None


def rms_norm_supports(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
    return (variance_size is None and weight is not None and weight.dtype == x.dtype
            and _served("rms_norm", x, x.shape[-1], epsilon))


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return torch.ops.prism.rms_norm(x, weight, epsilon)


def fused_add_rms_norm_supports(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                                variance_size: int | None = None) -> bool:
    return (variance_size is None and weight is not None and weight.dtype == x.dtype
            and x_residual.dtype == x.dtype and _served("fused_add_rms_norm", x, x.shape[-1], epsilon))


def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    return torch.ops.prism.fused_add_rms_norm(x, x_residual, weight, epsilon)


IMPLS = {"rms_norm": (rms_norm, rms_norm_supports), "fused_add_rms_norm": (fused_add_rms_norm,
                                                                            fused_add_rms_norm_supports)}


def _next_provider(ir_op) -> Callable:
    """A fallback that runs the provider vLLM would have chosen after prism (functionally)."""
    def run(*args):
        after = False
        for impl in ir_op._priority_impls:
            if impl.provider == PROVIDER:
                after = True
            elif after and impl.supports_args(*args):
                return impl.func_impl_fn(*args)
        return ir_op.impls["native"].impl_fn(*args)
    return run


def _install_ir(table: Table, done: Installed) -> None:
    from vllm import ir
    from vllm.platforms import current_platform

    served = [op for op in IR_OPS if table.ops.get(op)]
    if not served:
        return
    for op in served:
        ir_op = getattr(ir.ops, op)
        if PROVIDER not in ir_op.impls:
            impl, supports = IMPLS[op]
            ir_op.register_impl(PROVIDER, supported=True, supports_args=supports)(impl)
            done.undo.append(lambda o=ir_op: o.impls.pop(PROVIDER, None))
        ops.FALLBACKS[op] = _next_provider(ir_op)
        done.undo.append(lambda o=op: ops.FALLBACKS.__setitem__(o, getattr(ops, f"ref_{o}")))
    cls = type(current_platform)
    original = cls.__dict__.get("get_default_ir_op_priority")
    if getattr(cls.get_default_ir_op_priority, "_prism", False):
        done.names += [f"vllm.ir.{op}" for op in served]
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


# --- SiluAndMul through CustomOp.register_oot ----------------------------------------------

def _install_silu(table: Table, done: Installed) -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.platforms import current_platform

    if not table.ops.get("silu_and_mul"):
        return
    if "SiluAndMul" in op_registry_oot:
        if getattr(op_registry_oot["SiluAndMul"], "_prism", False):
            done.names.append("SiluAndMul")
        return  # another plugin replaced it first: leave theirs in place

    if current_platform.is_cuda_alike() and hasattr(torch.ops._C, "silu_and_mul"):
        def vllm_silu_and_mul(x: Tensor) -> Tensor:
            out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
            torch.ops._C.silu_and_mul(out, x)
            return out
        ops.FALLBACKS["silu_and_mul"] = vllm_silu_and_mul
        done.undo.append(lambda: ops.FALLBACKS.__setitem__("silu_and_mul", ops.ref_silu_and_mul))

    class PrismSiluAndMul(SiluAndMul):
        """vLLM's SiluAndMul whose every path runs `prism::silu_and_mul` (misses fall back inside)."""

        _prism = True

        def forward_native(self, x: Tensor) -> Tensor:
            return torch.ops.prism.silu_and_mul(x)

        forward_cuda = forward_cpu = forward_xpu = forward_hip = forward_oot = forward_native

    SiluAndMul.register_oot(PrismSiluAndMul, name="SiluAndMul")
    done.undo.append(lambda: op_registry_oot.pop("SiluAndMul", None))
    done.names.append("SiluAndMul")


HOOKS = (_install_ir, _install_silu)


def install(table: Table) -> Installed:
    """Define the prism ops, make `table` the live one and hook every op it serves into vLLM."""
    ops.define_ops()
    done = Installed([], [])
    previous = ops.STATE.table
    ops.STATE.table = table
    done.undo.append(lambda: setattr(ops.STATE, "table", previous))
    try:
        for hook in HOOKS:
            hook(table, done)
    except BaseException:
        done.revert()
        raise
    return done
