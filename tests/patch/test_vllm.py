"""The plugin inside real vLLM (CPU build, Triton interpreter), each run in a fresh process.

One process per (model, plugin on/off) runs both eager and compiled mode; each fault is its
own process (the plugin acts once per process). Greedy tokens must equal stock vLLM's, the
counters must show each patched op ran, and exactly one log line must say what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_serve.optimize.gpus import get_gpu
from prism_serve.optimize.workloads import programs
from prism_serve.patch import seed
from prism_serve.patch.device import current_device
from prism_serve.registry.store import DeviceInfo, Versions, current_versions

from .checkpoints import write_checkpoint
from .conftest import MODELS, fill, model_results

CHILD = Path(__file__).with_name("vllm_child.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")


def run_vllm(model: Path, registry: str | None, tmp: Path, *modes: str, **env) -> dict:
    out = tmp / f"out-{os.urandom(4).hex()}.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_SERVE_")}
    full.update(TRITON_INTERPRET="1", PRISM_SERVE_FORCE="1", PYTHONPATH=str(ROOT), **env)
    if registry is not None:
        full["PRISM_SERVE_REGISTRY"] = registry
    proc = subprocess.run([sys.executable, str(CHILD), str(model), str(out), *modes], env=full, cwd=tmp,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())
    result["log_lines"] = [line for line in log.splitlines() if "prism-serve:" in line]
    return result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {m: write_checkpoint(m, root / m) for m in MODELS}


@pytest.fixture(scope="module")
def runs(checkpoints, kernels_registry, tmp_path_factory):
    """Per model: stock vLLM and vLLM with the plugin, each in eager and compiled mode."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for m, path in checkpoints.items():
        out[m, "stock"] = run_vllm(path, kernels_registry, tmp, "eager", "compiled", PRISM_SERVE_DISABLE="1")
        out[m, "prism"] = run_vllm(path, kernels_registry, tmp, "eager", "compiled")
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_same_tokens_as_stock_and_every_op_ran(runs, model, mode):
    stock, prism = runs[model, "stock"], runs[model, "prism"]
    assert prism["runs"][mode]["tokens"] == stock["runs"][mode]["tokens"]
    assert all(prism["runs"][mode]["kernel"][op] > 0 for op in OPS), prism["runs"][mode]
    assert not any(prism["runs"][mode]["fallback"].values())
    assert not any(stock["runs"][mode]["kernel"].values())


@pytest.mark.parametrize("model", MODELS)
def test_one_log_line_says_what_was_patched(runs, model):
    prism, stock = runs[model, "prism"], runs[model, "stock"]
    assert prism["plugin"]["state"] == "patched"
    assert prism["plugin"]["patched"] == ["vllm.ir.rms_norm", "vllm.ir.fused_add_rms_norm", "SiluAndMul"]
    assert len(prism["log_lines"]) == 1 and "patched vllm.ir.rms_norm" in prism["log_lines"][0]
    assert "8 enabled or verified (forced) kernels" in prism["log_lines"][0]
    assert len(stock["log_lines"]) == 1 and "disabled by PRISM_SERVE_DISABLE=1" in stock["log_lines"][0]


def test_qwen3_qk_norm_is_patched_too(runs):
    # per decode step Llama runs one plain rms_norm (the final norm); Qwen3 adds q and k norm per layer
    llama, qwen = runs["tiny-llama", "prism"]["runs"]["eager"], runs["tiny-qwen3", "prism"]["runs"]["eager"]
    assert qwen["kernel"]["rms_norm"] == 5 * llama["kernel"]["rms_norm"]


# --- faults: vLLM serves stock output and one line says why nothing (or what) was patched ----

def _other_triton() -> Versions:
    v = current_versions()
    major, minor = (int(p) for p in v.triton.split(".")[:2])
    return Versions(torch=v.torch, triton=f"{major}.{minor + 1}.0", vllm=v.vllm, prism=v.prism)


def _faults(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (registry location, text the log line must hold)."""
    corrupt = tmp / "corrupt.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    h100 = DeviceInfo.from_spec(get_gpu("h100"))
    device = current_device(use_vllm=False)[0]
    silu = seed.results([programs.silu_and_mul(256, "float32")], device)
    broken = [type(r)(**{**r.__dict__, "params": {"BT": 16, "G": 3}}) for r in silu]  # 256 does not split in 3
    norms = [r for r in model_results() if r.program.name != "silu_and_mul"]
    return {
        "empty": (fill(tmp / "empty.db", []), "has no enabled or verified (forced) kernels for cpu:"),
        "missing": (str(tmp / "nowhere" / "registry.db"), "no registry at"),
        "corrupt": (str(corrupt), "cannot open registry"),
        "other device": (fill(tmp / "h100.db", [type(r)(**{**r.__dict__, "device": h100}) for r in model_results()]),
                         "for another device (gpu:h100"),
        "other triton": (fill(tmp / "triton.db", model_results(versions=_other_triton())), "built with triton"),
        "kernel fails to compile": (fill(tmp / "broken.db", norms + broken), "failed to compile"),
    }


@pytest.fixture(scope="module")
def fault_runs(checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    return {name: (run_vllm(checkpoints["tiny-llama"], url, tmp, "eager"), text, url)
            for name, (url, text) in _faults(tmp).items()}


@pytest.mark.parametrize("fault", ["empty", "missing", "corrupt", "other device", "other triton",
                                   "kernel fails to compile"])
def test_faults_serve_stock_output_with_one_clear_line(fault_runs, runs, fault):
    result, text, url = fault_runs[fault]
    stock = runs["tiny-llama", "stock"]["runs"]["eager"]["tokens"]
    assert result["runs"]["eager"]["tokens"] == stock
    assert len(result["log_lines"]) == 1, result["log_lines"]
    assert text in result["log_lines"][0], result["log_lines"][0]
    if fault == "kernel fails to compile":  # the norms still run; SiluAndMul stays vLLM's
        assert result["plugin"]["patched"] == ["vllm.ir.rms_norm", "vllm.ir.fused_add_rms_norm"]
        assert result["runs"]["eager"]["kernel"]["silu_and_mul"] == 0
        assert result["runs"]["eager"]["kernel"]["rms_norm"] > 0
    else:
        assert result["plugin"]["state"] in ("nothing", "error") and not result["plugin"]["patched"]
        assert not any(result["runs"]["eager"]["kernel"].values())
    if fault == "missing":
        assert not Path(url).parent.exists()  # the plugin never creates a registry
