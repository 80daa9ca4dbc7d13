"""The command line, through typer's runner."""

import json

from typer.testing import CliRunner

from prism_serve.cli import app
from prism_serve.optimize.workloads.programs import WORKLOADS
from prism_serve.registry import open_registry

runner = CliRunner()


def test_doctor_reports_versions_device_and_registry(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", str(tmp_path / "reg.sqlite"))
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["versions"]["torch"] and report["versions"]["triton"]
    assert report["registry"] == f"sqlite:///{tmp_path / 'reg.sqlite'}"
    assert report["device"]["kind"] in ("cpu", "cuda")
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", "postgresql://u@127.0.0.1/db")
    assert json.loads(runner.invoke(app, ["doctor", "--json"]).output)["registry"] == "postgresql://u@127.0.0.1/db"


def test_doctor_on_a_model_prints_compiled_and_eager_columns(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", str(tmp_path / "reg.sqlite"))
    result = runner.invoke(app, ["doctor", "tiny-llama"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    head = next(line for line in result.output.splitlines() if "layer" in line and "op" in line)
    assert "compiled" in head and "eager" in head
    assert "sites from config.json" in result.output


def test_doctor_refuses_a_dtype_typo_and_a_config_without_layers_in_one_line(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for args, needle in ((["--dtype", "flaot16", "tiny-llama"], "dtype 'flaot16' is not one of"),
                         ([str(bad)], "does not describe a LlamaForCausalLM's layers: KeyError 'hidden_size'")):
        result = runner.invoke(app, ["doctor", *args])
        assert result.exit_code == 1
        (line,) = result.output.strip().splitlines()
        assert line.startswith("error: ") and needle in line, result.output


def test_workloads_lists_every_workload():
    result = runner.invoke(app, ["workloads"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in WORKLOADS:
        assert name in result.output


def test_demo_runs_the_generated_kernel_and_checks_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path))
    result = runner.invoke(app, ["demo", "rms_norm", "-n", "1", "-n", "3"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "generated kernel vs reference" in result.output and result.output.count("yes") == 2
    assert list((tmp_path / "kernels").glob("k_*.py"))


def test_unknown_workload_is_one_clear_line():
    result = runner.invoke(app, ["demo", "nope"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [result.output.strip()]  # one line, no traceback
    assert "unknown workload 'nope'" in result.output


def test_registry_sub_app_is_wired_in(tmp_path):
    db = tmp_path / "r.db"
    missing = runner.invoke(app, ["registry", "list", "--registry", str(db), "--json"])
    assert missing.exit_code == 1 and missing.output == f"error: no registry at {db}\n" and not db.exists()
    gc = runner.invoke(app, ["registry", "gc", "--registry", str(db)])  # a removal never makes one either
    assert gc.exit_code == 1 and gc.output == f"error: no registry at {db}\n" and not db.exists()
    open_registry(db).close()  # a writer (warmup, import) creates it
    result = runner.invoke(app, ["registry", "list", "--registry", str(db), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []


def test_sub_apps_are_wired():
    for command, expected in (["registry", "--help"], "export"), (["capture", "--help"], "config.json"):
        result = runner.invoke(app, command, env={"COLUMNS": "200"})
        assert result.exit_code == 0 and expected in result.output


def test_optimize_prints_verified_kernels_and_writes_source_and_json(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "result.json"
    result = runner.invoke(app, ["optimize", "rms_norm", "--shape", "hidden=96", "-n", "1", "-n", "64",
                                 "--emit", str(tmp_path / "emit"), "--json", str(out), "--top", "2"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "verified kernels" in result.output and "vs vLLM modeled" in result.output
    assert "vLLM's path:" in result.output and "modeled" in result.output
    data = json.loads(out.read_text())
    assert data["found"] and all(f["proof"]["ok"] for f in data["found"])
    assert data["stats"]["verified"] == len(data["found"]) and data["num_tokens"] == [1, 64]
    # the static check is on by default: every chosen instance compiled for the H100's sm_90, none spilling
    assert "sm_90 registers (stack bytes)" in result.output and "ptxas check" in result.output
    facts = [f for found in data["found"] for k in found["kernels"] for f in k["ptxas"]]
    assert facts and all(f["capability"] == 90 and f["stack_bytes"] == 0 and f["registers"] > 0 for f in facts)
    sources = sorted((tmp_path / "emit").glob("rms_norm_1_n*.py"))
    assert [p.name for p in sources] == ["rms_norm_1_n1.py", "rms_norm_1_n64.py"]
    assert "@triton.jit" in sources[0].read_text()


def test_optimize_rejects_bad_programs_with_one_line_naming_the_node(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ir_version": 1, "name": "bad", "outputs": ["y"], "nodes": [
        {"name": "x", "op": "input", "attrs": {"shape": ["num_tokens", 8], "dtype": "float16"}},
        {"name": "w", "op": "input", "attrs": {"shape": [4], "dtype": "float16"}},
        {"name": "y", "op": "mul", "inputs": ["x", "w"]}]}))
    for args, expected in ((["optimize", str(bad)], "node 'y'"),
                           (["optimize", "nope"], "neither a workload"),
                           (["optimize", "rms_norm", "--shape", "hidden"], "name=int")):
        result = runner.invoke(app, args)
        assert result.exit_code == 1
        assert expected in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_optimize_all_lists_every_verified_design_of_the_generator_with_its_hash(tmp_path, monkeypatch):
    """`optimize W --all --json F` (#11 item 6): the generator's every verified design, each with
    the canonical hash of its sGraph, the same set as the library call lists."""
    from prism_serve.optimize.ir.canonical import canonical_hash
    from prism_serve.optimize.pipeline.search import optimize
    from prism_serve.optimize.workloads.programs import WORKLOADS

    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "all.json"
    result = runner.invoke(app, ["optimize", "silu_and_mul", "--shape", "intermediate=40", "-n", "4", "--all",
                                 "--max-kernels", "1", "--workers", "1", "--json", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "canonical hash" in result.output and "workers" in result.output
    found = json.loads(out.read_text())["found"]
    listed = optimize(WORKLOADS["silu_and_mul"].program(intermediate=40), "h100", (4,), max_kernels=1,
                      all_designs=True, workers=1, budget_s=600)
    assert len(found) == len(listed.found) >= 2
    assert {f["canonical_hash"] for f in found} == {canonical_hash(f.sgraph) for f in listed.found}
    assert all(f["proof"]["ok"] for f in found)


def test_optimize_refuses_a_worker_count_below_one_in_one_line():
    result = runner.invoke(app, ["optimize", "silu_and_mul", "--workers", "0"])
    assert result.exit_code == 1 and "workers must be a positive int" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_optimize_folds_its_table_to_100_columns_and_logs_its_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    result = runner.invoke(app, ["optimize", "silu_and_mul", "--shape", "intermediate=40", "-n", "4", "-n", "64",
                                 "--max-kernels", "1", "--workers", "1"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100, result.output
    assert lines[0].startswith("optimize") and lines[0].endswith("search silu_and_mul: started")
    assert any("search silu_and_mul: done in" in line for line in lines)
    assert "modeled us @4, 64" in result.output and "1. " in result.output  # the designs folded under the table
