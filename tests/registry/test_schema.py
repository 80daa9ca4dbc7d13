"""Schema evolution, and databases that are not (or no longer) registries."""

from __future__ import annotations

import sqlite3

import pytest
from alembic import command
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text

from prism_serve.registry import RegistryError, open_registry
from prism_serve.registry.db import _alembic_config, current_revision, head_revision
from prism_serve.registry.store import add_kernel, counts, list_kernels
from tests.registry.factory import result


def _at_revision(url: str, revision: str) -> None:
    engine = create_engine(url)
    cfg = _alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    engine.dispose()


def test_older_schema_is_upgraded_in_place(registry_url):
    _at_revision(registry_url, "0001")
    engine = create_engine(registry_url)
    with engine.begin() as conn:  # a registry written by the first schema, with one kernel in it
        conn.execute(text("INSERT INTO devices (fingerprint, kind, name) VALUES ('cpu:x86_64', 'cpu', 'x86_64')"))
        conn.execute(text("INSERT INTO programs (hash, name, ir_json, created_at) "
                          "VALUES ('abc', 'p', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO sgraphs (hash, program_id, name, sgraph_json, proof, tests, created_at) "
                          "VALUES ('def', (SELECT id FROM programs), 'g', '{}', '{}', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text(
            "INSERT INTO kernels (program_id, sgraph_id, device_id, dtype, bucket_lo, bucket_hi, params_json, "
            "codegen_version, torch_version, triton_version, prism_version, status, reason, updated_at) "
            "VALUES ((SELECT id FROM programs), (SELECT id FROM sgraphs), (SELECT id FROM devices), 'float16', 1, 16, "
            "'{}', 1, '2.13', '3.8', '0.1', 'enabled', '', CURRENT_TIMESTAMP)"))
    engine.dispose()
    reg = open_registry(registry_url)
    assert current_revision(reg.engine) == head_revision() != "0001"
    with reg.read() as s:
        kernels = list_kernels(s)
        assert len(kernels) == 1 and kernels[0].warmup_run_id is None and counts(s)["warmup_runs"] == 0
    with reg.write() as s:
        add_kernel(s, result())
    reg.close()


def test_newer_schema_is_refused(registry_url):
    open_registry(registry_url).close()
    engine = create_engine(registry_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0999_from_the_future'"))
    engine.dispose()
    with pytest.raises(RegistryError, match=r"newer prism-serve.*'0999_from_the_future'.*upgrade prism-serve"):
        open_registry(registry_url)


def test_foreign_database_is_refused(registry_url):
    engine = create_engine(registry_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)"))
    engine.dispose()
    with pytest.raises(RegistryError, match="is not a prism-serve registry.*customers"):
        open_registry(registry_url)


def _filled(path) -> bytes:
    reg = open_registry(path)
    with reg.write() as s:
        for lo in range(1, 200, 2):
            add_kernel(s, result(bucket=(lo, lo + 1)))
    reg.close()
    con = sqlite3.connect(path)  # fold the WAL back so the main file is the whole database
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.execute("PRAGMA journal_mode=DELETE")
    con.close()
    return path.read_bytes()


def test_non_sqlite_file_is_refused_untouched(tmp_path):
    path = tmp_path / "registry.db"
    data = b"this is a text file, not a database\n" * 200
    path.write_bytes(data)
    with pytest.raises(RegistryError, match="cannot be read as a registry database.*not a database"):
        open_registry(path)
    assert path.read_bytes() == data


def test_foreign_sqlite_file_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE notes (body TEXT)")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(RegistryError, match="not a prism-serve registry"):
        open_registry(path)
    assert path.read_bytes() == before


def test_truncated_database_gives_clear_error(tmp_path):
    path = tmp_path / "registry.db"
    data = _filled(path)
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(RegistryError, match="registry .*(malformed|not a database|damaged)"):
        reg = open_registry(path)
        with reg.read() as s:
            list_kernels(s)
    assert path.read_bytes() == data[: len(data) // 3]


def test_corrupt_pages_give_clear_error(tmp_path):
    path = tmp_path / "registry.db"
    data = bytearray(_filled(path))
    page = int.from_bytes(data[16:18], "big")
    for i in range(page, len(data), 97):  # scribble over every page but the header page
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="registry"):
        reg = open_registry(path)
        with reg.read() as s:
            list_kernels(s)


def test_migrations_match_the_model(registry):
    """The head schema built by the migrations is the one the ORM model declares."""
    from alembic.autogenerate import compare_metadata

    from prism_serve.registry.models import Base
    with registry.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_schema_head_constant_is_the_migrations_head():
    from prism_serve.registry.db import SCHEMA_HEAD
    assert SCHEMA_HEAD == head_revision()
