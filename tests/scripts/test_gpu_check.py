"""The GPU check script, run whole in its --interpret mode: the same path the GPU run takes."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRISM_WORKLOADS = {"rmsnorm_linear", "rmsnorm_mlp", "swiglu", "attention", "qk_norm_attention"}
VLLM_OPS = {"rms_norm", "fused_add_rms_norm", "silu_and_mul"}
DECODER_REGIONS = {"fused_add_rmsnorm_linear", "rmsnorm_swiglu", "fused_add_rmsnorm_linear_bias"}
ROTARY = {"rotary", "qk_norm_rotary"}
MOE = {"moe_experts"}


def test_interpret_mode_checks_every_workload(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "PRISM_SERVE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--interpret"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["interpret"] and result["all_correct"] and not result["skipped"]
    cases = result["cases"]
    assert {c["workload"] for c in cases} == PRISM_WORKLOADS | VLLM_OPS | DECODER_REGIONS | ROTARY | MOE
    assert {c["dtype"] for c in cases} == {"bfloat16", "float16"}
    assert any(c["num_tokens"] == 1 for c in cases)
    for c in cases:
        assert c["correct"] and c["max_rel_error"] < 2e-2
        assert c["measured_us"] > 0 and c["eager_us"] > 0 and c["modeled_us"] > 0
        assert c["candidates"][0]["assignment"] == c["assignment"]
    assert any("compile_us" in c for c in cases), "the torch.compile baseline path was never exercised"
    # every region kind is timed against vLLM's own path (vLLM is installed here) beside its modeled price
    regions = [c for c in cases if c["workload"] in VLLM_OPS | DECODER_REGIONS | ROTARY | MOE | {"rmsnorm_linear", "swiglu"}]
    for c in regions:
        assert c["baseline"] == "vllm" and c["vllm_modeled_us"] > 0 and c["served_us"] > 0
        assert c.get("baseline_us", 0) > 0 or c.get("baseline_error"), c
    assert any(c.get("baseline_us") for c in regions)
    assert not any("vllm_modeled_us" in c for c in cases if c["workload"] in {"rmsnorm_mlp", "attention"})
    assert set(result["vllm_path_model"]) == {c["workload"] for c in regions}
    # the superoptimizer's committed designs, rebuilt for these tiny shapes, are checked beside the oracles
    searched = {c["workload"] for c in cases if c["design"] == "searched"}
    found = {w for p in (ROOT / "bench" / "results").glob("search-*.json")
             for w, r in json.loads(p.read_text())["workloads"].items() if r.get("best_design_json")}
    assert searched == found and ROTARY | {"rmsnorm_linear", "swiglu"} <= found
    assert all(c["describe"] != "hand-built" for c in cases if c["design"] == "searched")
    table = (tmp_path / "gpu_check.md").read_text()
    assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
    assert table.count("| yes |") == len(cases)


def test_the_searched_designs_come_from_the_newest_run_by_the_time_it_finished(tmp_path):
    """A run's name does not order it ("...-after-redesign" sorts before "...-before-redesign"): the
    time bench_search wrote into the JSON does, and runs from before it wrote one come first."""
    from scripts.gpu_check import searched_designs

    real = json.loads((ROOT / "bench" / "results" / "search-cpu-2026-12-07-rotary.json").read_text())
    one, other = (real["workloads"][w]["best_design_json"] for w in ("rotary", "qk_norm_rotary"))

    def write(name, design, finished=None):
        data = {"workloads": {"rotary": {"best_design_json": design}}} | ({"finished": finished} if finished else {})
        (tmp_path / f"search-{name}.json").write_text(json.dumps(data))

    write("a-after", one, "2026-12-07T02:00:00Z")
    write("b-before", other, "2026-12-07T01:00:00Z")
    write("c-untimed", other)
    assert searched_designs(None, tmp_path)["rotary"].to_json() == one
    write("a-after", one)
    assert searched_designs(None, tmp_path)["rotary"].to_json() == other
