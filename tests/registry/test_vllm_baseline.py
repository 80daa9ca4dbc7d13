"""Each kernel row stores vLLM's path for its region, modeled (and measured where a device timed
it), and `registry list` shows the speedup over vLLM's path saying which; rows from before
migration 0004 keep working and show none."""

from __future__ import annotations

import json

from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from prism_serve.baseline import served_modeled_us, vllm_modeled_us
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.registry import open_registry
from prism_serve.registry.cli import registry_app
from prism_serve.registry.store import add_kernel
from tests.registry.factory import DEVICES, program_and_sgraph, result
from tests.registry.test_schema import _at_revision

runner = CliRunner()
H200 = get_gpu("h200")


def _list(url: str) -> tuple[list[dict], str]:
    rows = json.loads(runner.invoke(registry_app, ["list", "--registry", url, "--json"]).output)
    table = runner.invoke(registry_app, ["list", "--registry", url], env={"COLUMNS": "300"}).output
    return rows, table


def test_list_says_modeled_or_measured_against_vllms_path(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    prog, _, _ = program_and_sgraph("rms_norm")
    base = vllm_modeled_us(prog, 16, H200)  # what warmup stores: the same model, vLLM's path
    modeled = dict(modeled_us=3.0, baseline_modeled_us=base, modeled_speedup=base / served_modeled_us(prog, 3.0, 16, H200))
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, result(bucket=(1, 16), measured_us=None, status="verified", **modeled))
        add_kernel(s, result(bucket=(17, 32), measured_us=4.0, baseline="vllm", baseline_us=5.0, **modeled))
        add_kernel(s, result(bucket=(33, 64), measured_us=4.0, baseline="torch-eager", baseline_us=8.0, **modeled))
    reg.close()
    rows, table = _list(url)
    by_bucket = {tuple(r["bucket"]): r for r in rows}
    assert by_bucket[(1, 16)]["vs_vllm"] == {"speedup": modeled["modeled_speedup"], "kind": "modeled"}
    assert by_bucket[(1, 16)]["baseline_modeled_us"] == base
    assert by_bucket[(17, 32)]["vs_vllm"] == {"speedup": 1.25, "kind": "measured"}
    # measured against torch eager is not vLLM's path: the row falls back to its modeled figure
    assert by_bucket[(33, 64)]["vs_vllm"]["kind"] == "modeled" and by_bucket[(33, 64)]["speedup"] == 2.0
    assert "vLLM modeled us" in table and "1.25x measured" in table
    assert f"{modeled['modeled_speedup']:.2f}x modeled" in table


def test_rows_from_before_the_migration_keep_working(registry_url):
    """A kernel stored at schema 0003 (no modeled baseline) lists after the upgrade, with no
    speedup claimed; new rows beside it carry theirs."""
    _at_revision(registry_url, "0003")
    engine = create_engine(registry_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO devices (fingerprint, kind, name) VALUES ('cpu:x86_64', 'cpu', 'x86_64')"))
        conn.execute(text("INSERT INTO programs (hash, name, ir_json, created_at) "
                          "VALUES ('abc', 'p', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO sgraphs (hash, program_id, name, sgraph_json, proof, tests, created_at) "
                          "VALUES ('def', (SELECT id FROM programs), 'g', '{}', '{}', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text(
            "INSERT INTO kernels (program_id, sgraph_id, device_id, dtype, bucket_lo, bucket_hi, params_json, "
            "codegen_version, torch_version, triton_version, prism_version, modeled_us, status, reason, updated_at) "
            "VALUES ((SELECT id FROM programs), (SELECT id FROM sgraphs), (SELECT id FROM devices), 'float16', 1, 16, "
            "'{}', 1, '2.13', '3.8', '0.1', 2.5, 'enabled', '', CURRENT_TIMESTAMP)"))
    engine.dispose()
    open_registry(registry_url).close()  # upgrades in place
    reg = open_registry(registry_url)
    with reg.write() as s:
        add_kernel(s, result(device=DEVICES[4], measured_us=None, baseline=None, baseline_us=None,
                             baseline_modeled_us=6.0, modeled_speedup=2.0))
    reg.close()
    rows, table = _list(registry_url)
    old = next(r for r in rows if r["program"] == "p")
    assert old["modeled_us"] == 2.5 and old["baseline_modeled_us"] is None and old["vs_vllm"] is None
    assert any(r["vs_vllm"] == {"speedup": 2.0, "kind": "modeled"} for r in rows)
    assert "2.00x modeled" in table
