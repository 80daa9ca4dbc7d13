"""The pieces of generated source every renderer shares: IR values as typed literals and
checked names (nothing else from an sGraph, its Program or a registry row reaches the source), and
`Value`, a tile of the kernel being written."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prism_serve.errors import CodegenError
from prism_serve.optimize.ir.program import code_spelling
from prism_serve.optimize.ir.schema import NAME
from prism_serve.optimize.target.gpus import GPU_NAME
from prism_serve.optimize.target.resources import pow2

TL_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}


def ident(name: str) -> str:
    """The generated variable of an IR name: ``v_`` and the name with each non-word character replaced."""
    return "v_" + code_spelling(label(name))


# Generated source holds only these renderings of IR values: no string from an sGraph, its
# Program or a registry row is pasted into it unless it passed the loader's name grammar.
def typed(value, *types: type):
    """`value` if its type is exactly one of `types` (floats finite), else CodegenError."""
    if type(value) in types and not (type(value) is float and not math.isfinite(value)):
        return value
    raise CodegenError(f"refusing to render {type(value).__name__} {value!r:.40} into generated source "
                       f"(expected {' or '.join(t.__name__ for t in types)})")


def lit(value) -> str:
    """The literal of an int, bool or finite float attribute."""
    return repr(typed(value, int, bool, float))


def gpu_label(name) -> str:
    """A GPU's name as it may appear in a comment of generated source (`gpus.GPU_NAME`)."""
    if type(name) is not str or not GPU_NAME.fullmatch(name):
        raise CodegenError(f"refusing to render GPU name {name!r:.40} into generated source")
    return name


def label(name) -> str:
    """A name (node, tensor, kernel, symbol) as it may appear in comments and messages."""
    if type(name) is not str or not NAME.fullmatch(name):
        raise CodegenError(f"refusing to render name {name!r:.40} into generated source")
    return name


def torch_dtype(dtype) -> str:
    if dtype not in TL_DTYPES:
        raise CodegenError(f"refusing to render dtype {dtype!r:.40} into generated source")
    return f"torch.{dtype}"


@dataclass(frozen=True)
class Value:
    """A tile in the generated code: its variable, true dims and the 1-D mask of each padded dim."""

    var: str
    dims: tuple[int, ...]
    masks: tuple[str | None, ...]

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(pow2(d) for d in self.dims)


def expand(var: str, dim: int, rank: int) -> str:
    """`var`, a 1-D tile, placed at dim `dim` of a rank-`rank` tile."""
    if rank == 1:
        return var
    return var + "[" + ", ".join(":" if i == dim else "None" for i in range(rank)) + "]"
