"""`prism-serve registry ...` through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from prism_serve.registry import open_registry
from prism_serve.registry.cli import registry_app
from prism_serve.registry.store import add_kernel
from tests.registry.factory import DEVICES, VERSIONS, result

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(registry_app, list(args), env={"COLUMNS": "250"})


def _seed(path) -> None:
    reg = open_registry(path)
    with reg.write() as s:
        add_kernel(s, result())
        add_kernel(s, result(workload="swiglu", hidden=256, device=DEVICES[0]))
        add_kernel(s, result(hidden=2048, status="disabled", reason="slower than vllm"))
    reg.close()


def test_list_show_json_and_table(tmp_path):
    db = str(tmp_path / "r.db")
    _seed(db)
    rows = json.loads(_invoke("list", "--registry", db, "--json").output)
    assert len(rows) == 3 and {r["status"] for r in rows} == {"enabled", "disabled"}
    assert [r["program"] for r in json.loads(_invoke("list", "--registry", db, "--device", "h100",
                                                     "--json").output)] == ["swiglu"]
    table = _invoke("list", "--registry", db)
    assert table.exit_code == 0 and "3 kernels" in table.output and "rms_norm" in table.output
    shown = json.loads(_invoke("show", str(rows[0]["id"]), "--registry", db, "--json").output)
    assert shown["proof"]["egglog"] == "proved" and shown["sources"][0][0] == "tiny-llama"
    assert _invoke("show", str(rows[0]["id"]), "--registry", db).exit_code == 0


def test_export_import_rm_gc(tmp_path):
    db, other, out = str(tmp_path / "r.db"), str(tmp_path / "o.db"), tmp_path / "export.json"
    _seed(db)
    assert json.loads(_invoke("export", str(out), "--registry", db, "--json").output) == {"exported": 3,
                                                                                          "path": str(out)}
    assert json.loads(_invoke("import", str(out), "--registry", other, "--json").output) == {"imported": 3}
    ids = [r["id"] for r in json.loads(_invoke("list", "--registry", other, "--json").output)]
    assert json.loads(_invoke("rm", str(ids[0]), str(ids[1]), "--registry", other, "--json").output) == {"removed": 2}
    removed = json.loads(_invoke("gc", "--registry", other, "--json").output)
    assert removed["programs"] + removed["sgraphs"] >= 2
    assert len(json.loads(_invoke("list", "--registry", other, "--json").output)) == 1


def test_bad_import_is_one_line_and_exit_1(tmp_path):
    db, out = str(tmp_path / "r.db"), tmp_path / "export.json"
    _seed(db)
    _invoke("export", str(out), "--registry", db)
    doc = json.loads(out.read_text())
    doc["records"][2]["sgraph"]["json"]["program"]["nodes"][0]["attrs"]["shape"][1] = "__import__('os').system('id')"
    out.write_text(json.dumps(doc))
    other = str(tmp_path / "o.db")
    got = _invoke("import", str(out), "--registry", other)
    assert got.exit_code == 1 and got.output.count("\n") == 1 and got.output.startswith("error: record #2")
    assert "attribute 'shape' dim must be int" in got.output
    assert _invoke("list", "--registry", other).output == f"error: no registry at {other}\n"  # none created


def test_damaged_registry_is_one_line_and_exit_1(tmp_path):
    path = tmp_path / "r.db"
    path.write_bytes(b"garbage" * 1000)
    got = _invoke("list", "--registry", str(path))
    assert got.exit_code == 1 and got.output.startswith("error: ") and "not a database" in got.output


def test_doctor_explains_what_loads(tmp_path, monkeypatch):
    db = str(tmp_path / "r.db")
    _seed(db)
    monkeypatch.setattr("prism_serve.registry.store.current_versions", lambda: VERSIONS)
    report = json.loads(_invoke("doctor", "--registry", db, "--device", DEVICES[1].fingerprint, "--json").output)
    assert report["schema_revision"] == report["schema_head"] and report["integrity"] == "ok"
    assert report["kernels"] == {"loaded": 1, "status disabled": 1,
                                 f"for another device ({DEVICES[0].fingerprint})": 1}


def test_registry_from_environment(tmp_path, monkeypatch):
    db = tmp_path / "env.db"
    _seed(str(db))
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", str(db))
    assert len(json.loads(_invoke("list", "--json").output)) == 3


def test_an_export_to_a_folder_or_nowhere_and_a_removal_from_a_mistyped_registry_are_one_line(tmp_path):
    db = str(tmp_path / "r.db")
    _seed(db)
    for target, why in ((tmp_path, "Is a directory"), (tmp_path / "no" / "x.json", "No such file or directory")):
        got = _invoke("export", str(target), "--registry", db)
        assert got.exit_code == 1 and got.output == f"error: cannot write the export at {target}: {why}\n", got.output
    typo = tmp_path / "typo" / "r.db"
    for args in (["gc"], ["rm", "1"]):
        got = _invoke(*args, "--registry", str(typo))
        assert got.exit_code == 1 and got.output == f"error: no registry at {typo}\n", got.output
    assert not (tmp_path / "typo").exists()  # nothing made in its place
