"""Codegen renders attribute values as typed literals: a block reduction that drops its dim
(keepdim false) computes what torch does, as does one that keeps it."""

from __future__ import annotations

import pytest

from prism_serve.optimize.gpus import get_gpu
from prism_serve.optimize.ir import Program, node
from prism_serve.optimize.sgraph import BlockKernel, GridAxis, SGraph, instantiate
from tests.optimize.kernel_check import check_instance


@pytest.mark.parametrize("keepdim", [False, True])
def test_block_reduction_keeps_or_drops_its_dim_as_torch_does(keepdim):
    prog = Program("rowsum", (node("x", "input", shape=("num_tokens", 48), dtype="float32"),
                              node("s", "sum", "x", dim=-1, keepdim=keepdim), node("e", "exp", "s")), ("e",))
    k = BlockKernel("rowsum", (GridAxis("BT", over_tokens=True),), None, (
        node("x", "load", tensor="x", imap=(0,), fmap=None), node("s", "sum", "x", dim=-1, keepdim=keepdim),
        node("e", "exp", "s"), node("out", "store", "e", tensor="e", omap=(0,))))
    inst = instantiate(SGraph("rowsum_block", prog, (), (k,)), {"BT": 4}, get_gpu("h100"))
    for n in (1, 7):
        check_instance(inst, n, "float32")
