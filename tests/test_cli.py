"""The command line, through typer's runner."""

import json

from typer.testing import CliRunner

from prism_serve.cli import app
from prism_serve.optimize.workloads.programs import WORKLOADS

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
    result = runner.invoke(app, ["registry", "list", "--registry", str(db), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []


def test_sub_apps_are_wired():
    for command, expected in (["registry", "--help"], "export"), (["capture", "--help"], "config.json"):
        result = runner.invoke(app, command, env={"COLUMNS": "200"})
        assert result.exit_code == 0 and expected in result.output
