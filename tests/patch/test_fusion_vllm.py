"""The fusion pass inside real vLLM (CPU build, compiled mode, Triton interpreter): put into
vLLM's config by the platform hook, run by Inductor on the model's graph, it replaces the tiny
Llama's norms and activations with prism ops whose kernels then run, and greedy tokens equal
stock vLLM's. The pass is the only prism hook here, so every prism op call comes from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_serve.capture.embedded import embedded_path

from ..checkpoints import write_checkpoint

CHILD = Path(__file__).with_name("fusion_child.py")
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


def run_child(model: Path, registry: str, tmp: Path, how: str) -> dict:
    out = tmp / f"{how}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_SERVE_")}
    # fresh compile caches: a cached graph (same pass uuid) would come back rewritten without the pass running
    env.update(TRITON_INTERPRET="1", PRISM_SERVE_DISABLE="1", PRISM_SERVE_FORCE="1", PRISM_SERVE_REGISTRY=registry,
               PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor-{how}"),
               VLLM_CACHE_ROOT=str(tmp / f"vllm-{how}"))
    proc = subprocess.run([sys.executable, str(CHILD), str(model), str(out), how], check=False, env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(kernels_registry, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fusion")
    model = tmp / MODEL
    write_checkpoint(MODEL, model)
    return {how: run_child(model, kernels_registry, tmp, how) for how in ("stock", "pass")}


def test_the_pass_replaces_regions_inside_vllm_with_stock_tokens(runs):
    stock, fused = runs["stock"], runs["pass"]
    layers = json.loads((embedded_path(MODEL) / "config.json").read_text())["num_hidden_layers"]
    assert fused["tokens"] == stock["tokens"]
    # vLLM's CPU build compiles with Inductor in mode 2 and ran the pass the hook put in its config
    assert (fused["mode"], fused["backend"], fused["config_pass"]) == (2, "inductor", "PrismFusionPass")
    assert stock["config_pass"] == "NoneType" and fused["installed"] == ["fusion pass (compiled mode)"]
    assert fused["graphs"] >= 1
    # per graph: the first input norm, every later norm with its residual add, each MLP's activation
    assert fused["replaced"] == {"rms_norm": 1, "fused_add_rms_norm": 2 * layers, "silu_and_mul": layers}
    ran = fused["counters"]["kernel"]
    assert ran["rms_norm"] > 0 and not any(fused["counters"]["fallback"].values())
    assert ran["fused_add_rms_norm"] == 2 * layers * ran["rms_norm"] and ran["silu_and_mul"] == layers * ran["rms_norm"]
    assert not any(stock["counters"]["kernel"].values())
