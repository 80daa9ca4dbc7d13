"""A capture without vLLM, for the fleet tests: one served region (the final norm,
fused_add_rms_norm, hidden HIDDEN) recorded on random inputs with the reference's outputs.
Importable by name, so a driver in a child process can use it too."""

from __future__ import annotations

import json
from pathlib import Path

from prism_serve.capture.runner import CaptureResult, Instance, Region
from prism_serve.optimize.ir.reference import evaluate, random_inputs
from prism_serve.region_table import KINDS

HIDDEN = 32
TOKENS = 8
KIND = "fused_add_rms_norm"


def model_dir(root: Path, name: str = "fake-llama") -> Path:
    """A model directory (its config.json is what warmup's fingerprint reads)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}))
    return d


def capture(model, dtype: str = "auto") -> CaptureResult:
    dims = {"hidden": HIDDEN}
    prog = KINDS[KIND].program(dims, "float32", 1e-6)
    inputs = random_inputs(prog, TOKENS, seed=0)
    outputs = evaluate(prog, inputs)
    inst = Instance(KIND, 1, ["norm"], dims, 1e-6, "float32", True, None, prog, [(TOKENS, inputs, outputs)])
    region = Region(KIND, prog, dims, 1e-6, "float32", True, None, [1], ["norm"], 1.0, [TOKENS])
    return CaptureResult(str(model), "LlamaForCausalLM", "dummy", [region], [inst], {TOKENS: 1}, [TOKENS],
                         [TOKENS], 0.0, classes={"norm": "RMSNorm"}, dtype="float32")
