"""Reading a registry never writes or creates it: misspelt paths, sealed files, URI-style URLs,
and a registry on a read-only volume (a real read-only bind mount) for list, doctor and the plugin."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prism_serve.optimize.workloads import programs
from prism_serve.patch import seed
from prism_serve.patch.device import current_device
from prism_serve.patch.plugin import plan
from prism_serve.registry import RegistryError, add_kernel, open_registry
from prism_serve.registry.cli import registry_app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
READERS = (["list"], ["doctor"], ["show", "1"], ["export", "out.json"])


def _invoke(*args: str):
    return runner.invoke(registry_app, list(args), env={"COLUMNS": "250"})


def _seeded(path: Path) -> str:
    """A registry with real, proven rms_norm kernels for this device (both buckets)."""
    device = current_device(use_vllm=False)[0]
    reg = open_registry(path)
    with reg.write() as s:
        for r in seed.results([programs.rms_norm(64, "float32")], device):
            add_kernel(s, r)
    reg.close()
    return str(path)


def _journal(path: Path) -> str:
    con = sqlite3.connect(path)  # the last connection to close removes the WAL's side files
    try:
        return con.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        con.close()


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}


@pytest.mark.parametrize("command", READERS)
def test_a_misspelt_registry_is_one_line_and_nothing_is_created(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "typo" / "registry.db"
    got = _invoke(*command, "--registry", str(missing))
    assert got.exit_code == 1 and got.output == f"error: no registry at {missing} (there is no folder {missing.parent})\n"
    assert sorted(os.listdir(tmp_path)) == []


def test_the_plugin_does_not_create_a_misspelt_registry(tmp_path):
    missing = tmp_path / "registry.db"
    p = plan(str(missing), current_device(use_vllm=False)[0], "cpu", force=True)
    assert p.state == "nothing" and p.message == (f"prism-serve: nothing patched: no registry at {missing} "
                                                  f"(run `prism-serve warmup`)")
    assert not missing.exists()


def test_seal_folds_the_wal_and_reading_a_sealed_registry_writes_nothing(tmp_path):
    path = tmp_path / "registry.db"
    url = _seeded(path)
    con = sqlite3.connect(path)  # a reader holding the WAL open keeps it there until it closes
    assert con.execute("SELECT count(*) FROM kernels").fetchone() == (2,) and _journal(path) == "wal"
    con.close()
    got = _invoke("seal", "--registry", url, "--json")
    assert got.exit_code == 0 and json.loads(got.output) == {"sealed": str(path)}
    assert _journal(path) == "delete" and sorted(os.listdir(tmp_path)) == ["registry.db"]
    before = _snapshot(tmp_path)
    rows = json.loads(_invoke("list", "--registry", url, "--json").output)
    doctor = json.loads(_invoke("doctor", "--registry", url, "--json").output)
    p = plan(url, current_device(use_vllm=False)[0], "cpu", force=True)
    assert len(rows) == 2 and doctor["counts"]["kernels"] == 2 and doctor["journal_mode"] == "delete"
    assert p.state == "ready" and p.table.kernels() == 2
    reader = open_registry(url, readonly=True)
    with pytest.raises(RegistryError, match="opened read-only"), reader.write():
        pass
    reader.close()
    assert _snapshot(tmp_path) == before  # same files, same bytes, same times
    reg = open_registry(url)  # a writer switches WAL back on
    reg.close()
    assert _journal(path) == "wal"


def test_seal_refuses_what_it_cannot_seal_in_one_line(tmp_path):
    missing = _invoke("seal", "--registry", str(tmp_path / "none.db"))
    assert missing.exit_code == 1 and missing.output == f"error: no registry at {tmp_path / 'none.db'}\n"
    assert not (tmp_path / "none.db").exists()
    server = _invoke("seal", "--registry", "postgresql+psycopg://prism@127.0.0.1:1/registry")
    assert server.exit_code == 1 and "is not a SQLite file: only files are sealed" in server.output


def test_an_older_schema_is_reported_not_migrated_by_a_reader(tmp_path):
    path = tmp_path / "registry.db"
    _seeded(path)
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = '0001'")
    con.commit()
    con.close()
    before = path.read_bytes()
    got = _invoke("list", "--registry", str(path))
    assert got.exit_code == 1 and "has schema revision '0001'" in got.output and len(got.output.splitlines()) == 1
    assert path.read_bytes() == before


def test_an_immutable_uri_url_reads_without_a_stray_folder(tmp_path, monkeypatch):
    path = tmp_path / "registry.db"
    _seeded(path)
    shutil.copy(path, tmp_path / "shipped.db")  # closed cleanly: the file alone is the database
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    url = f"sqlite:///file:{tmp_path / 'shipped.db'}?immutable=1&uri=true"
    assert len(json.loads(_invoke("list", "--registry", url, "--json").output)) == 2
    assert plan(url, current_device(use_vllm=False)[0], "cpu", force=True).table.kernels() == 2
    assert os.listdir(cwd) == []


READ_ALL = """
import json, sys
from typer.testing import CliRunner
from prism_serve.patch.device import current_device
from prism_serve.patch.plugin import plan
from prism_serve.registry.cli import registry_app
out = {}
for url in sys.argv[1:]:
    got = {}
    for cmd in ("list", "doctor"):
        r = CliRunner().invoke(registry_app, [cmd, "--registry", url, "--json"])
        got[cmd] = json.loads(r.output) if r.exit_code == 0 else r.output
    p = plan(url, current_device(use_vllm=False)[0], "cpu", force=True)
    got["plugin"] = [p.state, p.message, p.table.kernels() if p.table else 0]
    out[url] = got
print(json.dumps(out))
"""


def _read_only_volume(folder: Path, *urls: str) -> dict:
    """Run list, doctor and the plugin's plan on `urls` with `folder` mounted read-only (a bind
    mount in a private mount namespace; chmod as a plain user where namespaces are not allowed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PRISM_SERVE_CACHE": str(folder.parent / "cache")}
    script = [sys.executable, "-c", READ_ALL, *urls]
    mount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && touch {folder}/w 2>/dev/null; "
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount + "test ! -e " + str(folder / "w")],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is not None and probe.returncode == 0:
        cmd = ["unshare", "-rm", "sh", "-c", f"mount --bind {folder} {folder} && "
               f"mount -o remount,bind,ro {folder} && exec \"$@\"", "sh", *script]
    elif os.geteuid() != 0:
        for p in folder.iterdir():
            p.chmod(0o444)
        folder.chmod(0o555)
        cmd = script
    else:
        pytest.fail("cannot make a read-only folder: running as root and `unshare -rm` (a private mount "
                    f"namespace) is not allowed here: {probe.stderr if probe else 'no unshare'}", pytrace=False)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    folder.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_list_doctor_and_the_plugin_read_a_registry_on_a_read_only_volume(tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    sealed, wal = volume / "sealed.db", volume / "wal.db"
    _seeded(sealed)
    _invoke("seal", "--registry", str(sealed))
    _seeded(wal)  # left in WAL mode, closed cleanly
    assert _journal(wal) == "wal" and not (volume / "wal.db-wal").exists()
    before = _snapshot(volume)
    got = _read_only_volume(volume, str(sealed), str(wal))
    for url in (str(sealed), str(wal)):
        assert len(got[url]["list"]) == 2, got[url]
        assert got[url]["doctor"]["counts"]["kernels"] == 2 and got[url]["doctor"]["integrity"] == "ok"
        assert got[url]["plugin"][0] == "ready" and got[url]["plugin"][2] == 2, got[url]
    assert _snapshot(volume) == before


def test_a_reader_cannot_write_even_by_hand(registry_url):
    """SQLite opened `mode=ro`, PostgreSQL in read-only transactions: the database refuses."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    open_registry(registry_url).close()
    reader = open_registry(registry_url, readonly=True)
    try:
        with pytest.raises(DBAPIError, match="read-?only"), reader.engine.begin() as conn:
            conn.execute(text("CREATE TABLE intruder (x INTEGER)"))
    finally:
        reader.close()
