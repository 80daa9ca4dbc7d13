"""Snapshot of generated Triton source, so changes to generated code show up in review.

Regenerate with PRISM_UPDATE_SNAPSHOTS=1 after an intended codegen change.
"""

import os
from pathlib import Path

import pytest

from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

SNAPSHOTS = Path(__file__).parent / "snapshots"
CASES = {
    "rms_norm": ({"hidden": 100}, {"BT": 4}),
    "rmsnorm_linear": ({"hidden": 96, "out": 48}, {"BT": 16, "G": 2, "F": 4}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_source_matches_snapshot(name):
    dims, assignment = CASES[name]
    g = oracle(WORKLOADS[name].program(**dims, dtype="float16"))
    source = render(instantiate(g, assignment, get_gpu("h100")), interpret=False)
    path = SNAPSHOTS / f"{name}.py.txt"
    if os.environ.get("PRISM_UPDATE_SNAPSHOTS") == "1":
        path.write_text(source)
    assert source == path.read_text(), f"generated source changed; review and regenerate {path.name}"


def test_four_axis_grid_source_matches_snapshot():
    """GQA decode over (batch, kv head, q block, KV split): the middle axes share launch dim 1."""
    from prism_serve.optimize.workloads.designs import gqa_decode

    prog = WORKLOADS["attention"].program(batch=2, heads=6, kv_heads=2, kv_len=48, head_dim=24, dtype="float16")
    source = render(instantiate(gqa_decode(prog), {"B": 2, "H": 2, "Q": 3, "S": 2, "F": 3}, get_gpu("h100")),
                    interpret=False)
    path = SNAPSHOTS / "attention_gqa_decode.py.txt"
    if os.environ.get("PRISM_UPDATE_SNAPSHOTS") == "1":
        path.write_text(source)
    assert source == path.read_text(), f"generated source changed; review and regenerate {path.name}"
