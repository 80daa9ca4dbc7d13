"""Why nothing ran: the registry holds kernels for a region kind on this device, but none for what
vLLM runs (its dtype, its sizes, its epsilon). Kernels are keyed by all three, so serving a model in
another dtype than the one it was warmed in serves nothing, correctly; this says so in one line,
with the `prism-serve warmup` command that would fill the gap. The plugin logs it at a kind's first
such miss (`ops.run`); the doctor adds it to a row's reason.
"""

from __future__ import annotations

from collections.abc import Iterable

from prism_serve.region_table import KINDS


def _dtype(dt) -> str:
    """A dtype's name: "bfloat16" for torch.bfloat16 or "bfloat16"."""
    return str(dt).split(".")[-1]


def _dims(kind: str, dim) -> str:
    sizes = dim if isinstance(dim, tuple) else (dim,)
    return ", ".join(f"{name} {n}" for name, n in zip(KINDS[kind].key_names, sizes))


def mismatch(kind: str, want: tuple, held: Iterable[tuple], model: str | None = None) -> str | None:
    """What differs between the key vLLM's call needs (`want`: dtype, dim, eps) and every key the
    table holds for `kind` (`held`), and the warmup command that would add kernels for it; None where
    none is held or one matches (a miss of its num_tokens buckets only)."""
    held = list(held)
    dtype, dim, eps = want
    if not held or any(k == (dtype, dim, eps) for k in held):
        return None
    same_dtype = [k for k in held if _dtype(k[0]) == _dtype(dtype)]
    same_dims = [k for k in same_dtype if k[1] == dim]
    if not same_dtype:
        have = ", ".join(sorted({_dtype(k[0]) for k in held}))
        runs = _dtype(dtype)
    elif not same_dims:
        have = "; ".join(sorted({_dims(kind, k[1]) for k in same_dtype})) + f" in {_dtype(dtype)}"
        runs = _dims(kind, dim)
    else:
        have = ", ".join(sorted({f"epsilon {k[2]}" for k in same_dims}))
        runs = f"epsilon {eps}"
    return (f"the registry's {kind} kernels for this device are for {have}, vLLM runs {runs}: "
            f"`prism-serve warmup {model or 'MODEL'} --dtype {_dtype(dtype)}` would add them")
