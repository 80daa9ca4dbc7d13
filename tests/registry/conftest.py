"""Registry fixtures: a fresh registry per test, on SQLite and on a real PostgreSQL server
started here on loopback. A missing PostgreSQL makes the PostgreSQL tests fail, not skip."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from prism_serve.registry.db import open_registry

PG_USER = "prism"


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        pytest.fail(f"PostgreSQL server binary {name!r} not found: run scripts/setup.sh (installs Debian's "
                    f"postgresql) — the registry must be tested against a real server", pytrace=False)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_db_user(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` system user then."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if not runuser:
        pytest.fail("running as root and `runuser` is missing: cannot start PostgreSQL", pytrace=False)
    return [runuser, "-u", "postgres", "--", *cmd]


@pytest.fixture(scope="session")
def postgres_server():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="prism-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        os.chmod(root, 0o700)
    port = _free_port()
    run = dict(check=True, capture_output=True, text=True)
    try:
        subprocess.run(_as_db_user([initdb, "-D", str(data), "-U", PG_USER, "--auth=trust", "-E", "UTF8",
                                    "--no-sync"]), **run)
        opts = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c full_page_writes=off"
        subprocess.run(_as_db_user([pg_ctl, "-D", str(data), "-l", str(root / "log"), "-o", opts, "-w", "-t", "60",
                                    "start"]), **run)
    except subprocess.CalledProcessError as exc:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        pytest.fail(f"could not start PostgreSQL: {exc.stderr or exc.stdout}\n{log}", pytrace=False)
    try:
        yield f"postgresql+psycopg://{PG_USER}@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_db_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _new_pg_database(server: str) -> str:
    import sqlalchemy as sa
    name = "t_" + uuid.uuid4().hex[:12]
    eng = sa.create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    eng.dispose()
    return f"{server}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return _new_pg_database(request.getfixturevalue("postgres_server"))


@pytest.fixture
def registry(registry_url):
    reg = open_registry(registry_url)
    yield reg
    reg.close()
