"""Why nothing ran: the one line for kernels of another dtype, size or epsilon than vLLM runs."""

from __future__ import annotations

import logging

import torch

from prism_serve.patch import ops
from prism_serve.patch.explain import mismatch
from prism_serve.patch.table import Buckets, Table

BF16, F32, EPS = torch.bfloat16, torch.float32, 1e-6


def test_the_line_names_what_differs_and_the_command_that_fills_the_gap():
    held = [(BF16, 256, None), (BF16, 128, None)]
    assert mismatch("silu_and_mul", (F32, 256, None), held, "m") == (
        "the registry's silu_and_mul kernels for this device are for bfloat16, vLLM runs float32: "
        "`prism-serve warmup m --dtype float32` would add them")
    assert "are for hidden 2048, out 96 in float32, vLLM runs hidden 128, out 96" in mismatch(
        "rmsnorm_linear", (F32, (128, 96), EPS), [(F32, (2048, 96), EPS)])
    assert "are for epsilon 1e-06, vLLM runs epsilon 1e-05" in mismatch("rms_norm", (F32, 128, 1e-5), [(F32, 128, EPS)])
    assert mismatch("rms_norm", (F32, 128, EPS), [(F32, 128, EPS)]) is None  # a bucket miss: the key is there
    assert mismatch("rms_norm", (F32, 128, EPS), []) is None  # nothing for the kind: nothing to say


def test_the_first_miss_of_a_kind_says_it_once(caplog):
    tab = Table("cpu")
    tab.ops["silu_and_mul"] = {(BF16, 64, None): Buckets()}
    rt = ops.open_runtime(tab)
    with caplog.at_level(logging.WARNING, logger="vllm.prism_serve.ops"):
        for _ in range(3):
            torch.ops.prism.silu_and_mul(torch.randn(4, 128))
    lines = [r.getMessage() for r in caplog.records if "ran vLLM's path" in r.getMessage()]
    assert lines == ["prism-serve: silu_and_mul ran vLLM's path: the registry's silu_and_mul kernels for this "
                     "device are for bfloat16, vLLM runs float32: `prism-serve warmup MODEL --dtype float32` "
                     "would add them"]
    assert rt.misses["silu_and_mul"] == 3
