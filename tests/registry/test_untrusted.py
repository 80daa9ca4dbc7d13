"""Registry data can never become code: the attacks of issue #12 (1-3 and 7), each through the
real `prism-serve registry import` (typer's CliRunner), and the same data written straight into
a registry database (an attacker with write access to a shared registry)."""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
import time

import pytest

from prism_serve.errors import CodegenError
from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.ir.program import node
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.registry import open_registry
from prism_serve.registry.gate import IMPORTED_REASON
from prism_serve.registry.store import add_kernel, best_kernel, list_kernels
from tests.registry.factory import DEVICES, program_and_sgraph, result
from tests.registry.untrusted import HIDDEN, block_node, cli, export_doc, import_doc, stored_rows


def payload(marker) -> str:
    """Attack 1's attribute value: Python that writes `marker`, its code hidden in an integer."""
    code = f"open({str(marker)!r}, 'w').write('ran')".encode()
    return f"exec ((({int.from_bytes(code, 'big')}).to_bytes({len(code)}, 'big'))) or True"


def one_line_error(got) -> bool:
    return got.exit_code == 1 and got.output.startswith("error: ") and got.output.count("\n") == 1


def test_the_payload_is_live_python(tmp_path):
    """So that the refusals below mean something: evaluated, the payload writes its marker."""
    eval(payload(tmp_path / "live"))  # noqa: S307 - the point of the test
    assert (tmp_path / "live").read_text() == "ran"


@pytest.mark.parametrize("attr", ["keepdim", "dim"])
def test_attack1_code_in_an_attribute_is_refused_and_never_runs(tmp_path, attr):
    marker = tmp_path / "pwned"
    doc = export_doc(tmp_path)
    block_node(doc, "ms")["attrs"][attr] = payload(marker)
    got, db = import_doc(tmp_path, doc)
    assert one_line_error(got) and f"'{attr}' must be" in got.output, got.output
    assert not marker.exists() and stored_rows(db) == []


def test_attack1_codegen_renders_no_string_attribute(tmp_path):
    """Defence in depth: an sGraph built in memory with the payload as keepdim (the loader would
    refuse it) does not reach generated source either."""
    marker = tmp_path / "pwned"
    _, g, params = program_and_sgraph("rms_norm", HIDDEN, "float32")
    k = g.kernels[0]
    nodes = tuple(node("ms", "mean", *n.inputs, dim=-1, keepdim=payload(marker)) if n.name == "ms" else n
                  for n in k.nodes)
    bad = SGraph(g.name, g.program, g.intermediates, (dataclasses.replace(k, nodes=nodes),))
    with pytest.raises(CodegenError, match="refusing to render str"):
        render(instantiate(bad, params, get_gpu("h100")))
    assert not marker.exists()


def _tamper(db, old: str, new: str) -> None:
    con = sqlite3.connect(db)
    (text,) = con.execute("SELECT sgraph_json FROM sgraphs").fetchone()
    assert old in text
    con.execute("UPDATE sgraphs SET sgraph_json = ?", (text.replace(old, new, 1),))
    con.commit()
    con.close()


@pytest.mark.parametrize("what", ["keepdim payload", "power tower dim", "attribute chain dim"])
def test_tampered_registry_rows_are_skipped_by_the_loader(tmp_path, what):
    """The same data written straight into the database: the plugin's table build skips the row
    with its reason, quickly, and nothing runs."""
    from prism_serve.patch.table import build_table
    marker, db = tmp_path / "pwned", tmp_path / "r.db"
    reg = open_registry(db)
    with reg.write() as s:
        add_kernel(s, result(hidden=HIDDEN, dtype="float32"))
    if what == "keepdim payload":
        _tamper(db, '"keepdim":true', '"keepdim":' + json.dumps(payload(marker)))
    else:
        dim = "9**9**9**9" if what == "power tower dim" else "x.func.mro"
        _tamper(db, '"intermediates":[]', '"intermediates":[{"dtype":"float32","name":"t","shape":["%s"]}]' % dim)
    start = time.perf_counter()
    with reg.read() as s:
        table = build_table(list_kernels(s), "cpu")
    reg.close()
    assert time.perf_counter() - start < 5
    assert len(table.skipped) == 1 and "stored sGraph is invalid" in table.skipped[0][1]
    assert not marker.exists()


def test_attack2_foreign_status_timings_and_proof_are_not_trusted(tmp_path):
    doc = export_doc(tmp_path, status="enabled", measured_us=1e-6, baseline_us=50.0)
    doc["records"][0]["sgraph"]["proof"] = {"ok": True, "reason": "trust me"}
    got, db = import_doc(tmp_path, doc)
    assert got.exit_code == 0, got.output
    (row,) = stored_rows(db)
    assert row["status"] == "verified" and row["reason"] == IMPORTED_REASON
    assert row["measured_us"] is None and row["baseline_us"] is None and row["speedup"] is None
    shown = json.loads(cli("show", str(row["id"]), "--registry", str(db), "--json").output)
    assert shown["proof"]["ok"] is True and shown["proof"]["reason"] == "proven"
    assert shown["tests"]["recheck"]["max_rel_error"] <= 1e-4


def test_attack2_a_kernel_whose_proof_fails_is_refused(tmp_path):
    doc = export_doc(tmp_path, status="enabled")
    block_node(doc, "r")["op"] = "sqrt"  # well-typed, but no longer RMSNorm
    got, db = import_doc(tmp_path, doc)
    assert one_line_error(got) and "egglog proof does not hold" in got.output, got.output
    assert stored_rows(db) == []


def test_attack2_params_that_do_not_instantiate_are_refused(tmp_path):
    doc = export_doc(tmp_path, workload="rmsnorm_linear")
    doc["records"][0]["params"]["G"] = 3  # does not divide the output dim
    got, db = import_doc(tmp_path, doc)
    assert one_line_error(got) and "do not divide exactly" in got.output, got.output
    assert stored_rows(db) == []


def test_attack2_an_imported_tiny_time_does_not_win_a_bucket(tmp_path):
    local = result(hidden=HIDDEN, dtype="float32", bucket=(1, 16), measured_us=10.0)
    db = tmp_path / "target.db"
    reg = open_registry(db)
    with reg.write() as s:
        add_kernel(s, local)
    doc = export_doc(tmp_path, bucket=(1, 8), measured_us=1e-6, params={"BT": 4})
    got, _ = import_doc(tmp_path, doc)
    assert got.exit_code == 0, got.output
    with reg.read() as s:
        assert len(list_kernels(s)) == 2
        best = best_kernel(s, local.program.canonical_hash, "float32", DEVICES[1], 4)
        assert best.measured_us == 10.0 and best.params_json == '{"BT":16}'
    reg.close()


def test_attack2_an_import_never_overwrites_this_devices_kernel(tmp_path):
    doc = export_doc(tmp_path, measured_us=1e-6)  # the same kernel key as the local one below
    db = tmp_path / "target.db"
    reg = open_registry(db)
    with reg.write() as s:
        add_kernel(s, result(hidden=HIDDEN, dtype="float32", measured_us=10.0))
    got, _ = import_doc(tmp_path, doc)
    assert got.exit_code == 0 and "imported 0 kernels" in got.output and "1 already here" in got.output
    (row,) = stored_rows(db)
    assert row["status"] == "enabled" and row["measured_us"] == 10.0
    reg.close()


@pytest.mark.parametrize("dim", ["9**9**9**9", "2**2**26", "x.func.mro", "1 2", "S.func.mro()", "(" * 200 + "1"])
def test_attack3_dims_are_parsed_by_the_grammar_fast(tmp_path, dim):
    doc = export_doc(tmp_path)
    doc["records"][0]["sgraph"]["json"]["intermediates"] = [{"name": "t", "shape": [dim], "dtype": "float32"}]
    start = time.perf_counter()
    got, db = import_doc(tmp_path, doc)
    assert time.perf_counter() - start < 5
    assert one_line_error(got) and "intermediate 't'" in got.output, got.output
    assert stored_rows(db) == []


def _raw(doc, placeholder_edit, text_edit):
    placeholder_edit(doc)
    return text_edit(json.dumps(doc))


def _records(d):
    return d["records"][0]


ATTACK7 = {  # what to change -> (edit of the parsed export, or of its text), what the error says
    "bucket of 10**30": (lambda d: _records(d).update(bucket=[1, 10**30]), r"record #0.bucket must be int in"),
    "memory of 10**30": (lambda d: _records(d)["device"].update(memory_bytes=10**30),
                         r"record #0.device.memory_bytes must be int in"),
    "params of 10**30": (lambda d: _records(d)["params"].update(BT=10**30), "param 'BT' must be int in"),
    "const 'abc'": (lambda d: block_node(d, "eps")["attrs"].update(value="abc"), "'value' must be float"),
    "dim '1 2'": (lambda d: d["records"][0]["sgraph"]["json"]["program"]["nodes"][0]["attrs"].update(
        shape=["num_tokens", "1 2"]), "dim must be int"),
    "const inf": (lambda d: block_node(d, "eps")["attrs"].update(value=float("inf")), "not a finite number"),
    "NaN timing": (lambda d: _records(d).update(measured_us=float("nan")), "not a finite number"),
    "1e999 timing": ("1e999", "is not finite"),
    "integer of 5000 digits": ("9" * 5000, "more than 100 digits"),
    "nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "nested 1,000 deep": ("[" * 1000 + "]" * 1000, "nested too deeply"),
    "duplicate keys": ("DUPLICATE", "duplicate key 'measured_us'"),
    "same record twice": (lambda d: d["records"].append(json.loads(json.dumps(d["records"][0]))),
                          "record #1 repeats record #0"),
    "unknown sGraph key": (lambda d: d["records"][0]["sgraph"]["json"].update(shape_hints=[]),
                           r"unknown fields \['shape_hints'\]"),
    "unknown attribute": (lambda d: block_node(d, "x")["attrs"].update(evil=1), r"unknown attributes \['evil'\]"),
    "unknown record field": (lambda d: _records(d).update(source_code="x"), r"unknown fields \['source_code'\]"),
    "bool for an int": (lambda d: block_node(d, "ms")["attrs"].update(dim=True), "'dim' must be int"),
    "float for a bool": (lambda d: block_node(d, "ms")["attrs"].update(keepdim=1.0), "'keepdim' must be bool"),
    "name with a newline": (lambda d: block_node(d, "y").update(name="y\nimport os"), "name must be a name"),
}


@pytest.mark.parametrize("case", ATTACK7)
def test_attack7_malformed_imports_are_one_line_errors_and_write_nothing(tmp_path, case):
    edit, message = ATTACK7[case]
    doc = export_doc(tmp_path)
    if callable(edit):
        text = json.dumps(edit(doc) or doc)
    elif edit == "DUPLICATE":
        text = json.dumps(doc).replace('"measured_us": 10.0', '"measured_us": 10.0, "measured_us": 0.001', 1)
    else:
        _records(doc)["measured_us"] = "@@VALUE@@"
        text = json.dumps(doc).replace('"@@VALUE@@"', edit)
    got, db = import_doc(tmp_path, text)
    assert one_line_error(got), got.output
    assert re.search(message, got.output), got.output
    assert stored_rows(db) == []


def test_list_and_show_escape_control_characters(tmp_path):
    db = str(tmp_path / "r.db")
    reg = open_registry(db)
    with reg.write() as s:
        add_kernel(s, result(hidden=HIDDEN, dtype="float32", reason="\x1b]0;owned\x07\x1b[2J[bold red]x[/]"))
    reg.close()
    for args in (("list",), ("show", "1")):
        out = cli(*args, "--registry", db).output
        assert "\x1b" not in out and "\x07" not in out
        assert "\\x1b]0;owned\\x07\\x1b[2J[boldred]x[/]" in out.replace("\n", "").replace("│", "").replace(" ", "")
