"""The search benchmark's JSON, on one workload at its default shape."""

import json

import pytest

from prism_serve.optimize.pipeline.search import WORK_PER_S
from scripts.bench_search import main


def test_bench_search_reports_every_field(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # a 10 s budget (the default is 60 s): swiglu's search reaches the oracle's design in half of it
    assert main(["--json", str(out), "--workload", "swiglu", "--workers", "1", "--budget", "10"]) == 0
    data = json.loads(out.read_text())
    assert data["finished"].endswith("Z")  # when it was written (gpu_check takes the newest run's designs)
    r = data["workloads"]["swiglu"]
    assert set(r["pruned"]) == {"canonical", "shape", "schedule", "hardware", "abstract_expression", "cost"}
    assert r["verified"] >= 1 and r["kernel_graphs"] > 0 and r["block_graphs"] > 0 and r["search_s"] >= r["verify_s"] > 0
    assert r["concrete_graphs"] >= r["designs"] > 0 and r["workers"] == 1
    assert r["work"] == 10 * WORK_PER_S and 0 < r["steps"] and r["open_subtrees"] >= 0
    assert r["best_modeled_us"] <= r["oracle_modeled_us"] + 1e-9 < r["unfused_modeled_us"]
    assert "swiglu" in capsys.readouterr().out


def test_an_unknown_variant_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="unknown case 'moe_experts:nope'; the cases with variants are moe_experts:mixtral"):
        main(["--json", str(tmp_path / "b.json"), "--workload", "moe_experts:nope", "--workers", "1"])
