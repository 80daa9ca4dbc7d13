"""Run tests/patch/vllm_child.py: configs of the plugin, each as a fresh vLLM process would run it,
in one child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .vllm_child import MARK

CHILD = Path(__file__).with_name("vllm_child.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # per engine


def run_vllm(model: Path, tmp: Path, configs: list[dict]) -> dict:
    """Every config in one vLLM process (see vllm_child): name -> its result, with `log_lines`, the
    plugin's lines of that config's part of the log."""
    name = os.urandom(4).hex()
    out, spec = tmp / f"out-{name}.json", tmp / f"configs-{name}.json"
    spec.write_text(json.dumps(configs))
    full = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_SERVE_")}
    full.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(CHILD), str(model), str(out), str(spec)], check=False, env=full,
                          cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S * max(1, sum(len(c["modes"]) for c in configs)))  # per engine
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = json.loads(out.read_text())
    current = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            current = results[line[len(MARK):]]
            current["log_lines"] = []
        elif "prism-serve:" in line and current is not None:
            current["log_lines"].append(line)
    return results


def config(name: str, registry: str | None, *modes: str, faults: dict | None = None, dtype: str = "float32",
           **env) -> dict:
    """A vllm_child config: the plugin forced (verified kernels) on `registry`, as a fresh process,
    vLLM running the model in `dtype`."""
    env = {"PRISM_SERVE_FORCE": "1", **({"PRISM_SERVE_REGISTRY": registry} if registry is not None else {}), **env}
    return {"name": name, "env": env, "modes": list(modes), "dtype": dtype, **({"faults": faults} if faults else {})}
