"""The fusion pass inside real vLLM (CPU build, compiled mode, Triton interpreter), in one process:
stock vLLM first, then the registry's kernels installed as the plugin installs them, on tiny Qwen3
(tiny Llama's compiled run through the pass is test_vllm.py's, against its stock run).
The plugin's config hook puts the pass into vLLM's config, Inductor runs it on the model's graph,
and it replaces every decoder region the registry has a kernel for: the first layer's input norm
+ qkv projection, later layers' residual add + norm + qkv, and each post-attention residual add +
norm + gate_up + SiLU*mul, on vLLM's oneDNN projections. No Llama or Qwen class is touched in
compiled mode; greedy tokens equal stock vLLM's."""

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


def run_child(model: Path, registry: str, tmp: Path) -> dict:
    out = tmp / f"{model.name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_SERVE_")}
    # fresh compile caches: a cached graph (same pass uuid) would come back rewritten without the pass running
    env.update(TRITON_INTERPRET="1", PRISM_SERVE_DISABLE="1", PRISM_SERVE_FORCE="1", PRISM_SERVE_REGISTRY=registry,
               PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor-{model.name}"),
               VLLM_CACHE_ROOT=str(tmp / f"vllm-{model.name}"))
    proc = subprocess.run([sys.executable, str(CHILD), str(model), str(out)], check=False, env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def run(regions_registry, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fusion")
    write_checkpoint(MODEL, tmp / MODEL)
    return run_child(tmp / MODEL, regions_registry, tmp)


def test_the_pass_serves_every_decoder_region_with_stock_tokens(run):
    model = MODEL
    layers = json.loads((embedded_path(model) / "config.json").read_text())["num_hidden_layers"]
    assert run["tokens"] == run["stock"]
    # vLLM's CPU build compiles with Inductor in mode 2 and ran the pass the hook put in its config
    assert (run["mode"], run["backend"], run["config_pass"]) == (2, "inductor", "PrismFusionPass")
    assert "fusion pass (compiled mode)" in run["installed"] and run["graphs"] >= 1
    assert run["class_hooked"] == 0  # no Llama / Qwen class served anything in compiled mode
    # per graph: layer 0's norm + qkv, later layers' residual add + norm + qkv, every post-attention side
    assert run["replaced"] == {"rmsnorm_linear": 1, "fused_add_rmsnorm_linear": layers - 1, "rmsnorm_swiglu": layers}
    ran = run["kernel"]
    forwards = ran["rmsnorm_linear"]
    assert forwards > 0 and not any(run["fallback"].values()), run["fallback"]
    assert ran["fused_add_rmsnorm_linear"] == (layers - 1) * forwards and ran["rmsnorm_swiglu"] == layers * forwards
    assert ran["fused_add_rms_norm"] == forwards  # the final norm, an op of its own
    assert ran["swiglu"] == ran["silu_and_mul"] == 0  # stored too, but the larger region takes them in
    assert ran["rms_norm"] == 2 * layers * forwards  # Qwen3's q and k norms stay op-level RMSNorms
    # the plain weights recorded when vLLM packed them: each layer's gate_up and qkv (recording goes
    # by the shapes kernels serve, so lm_head, [vocab, hidden] = qkv's shape in this tiny model, too)
    cfg = json.loads((embedded_path(model) / "config.json").read_text())
    h, qkv = cfg["hidden_size"], (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    shapes = [tuple(s) for s in run["packed"]]
    assert shapes.count((2 * cfg["intermediate_size"], h)) == layers and shapes.count((qkv, h)) >= layers
    assert set(shapes) == {(2 * cfg["intermediate_size"], h), (qkv, h)}
