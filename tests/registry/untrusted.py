"""A small real export and the real `prism-serve registry import`, for the tests of untrusted input."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from prism_serve.registry import open_registry
from prism_serve.registry.cli import registry_app
from prism_serve.registry.store import add_kernel
from tests.registry.factory import result

runner = CliRunner()
HIDDEN = 64  # small, so the import's numeric check through the interpreter stays quick


def cli(*args: str):
    return runner.invoke(registry_app, list(args), env={"COLUMNS": "250"})


def export_doc(tmp: Path, **kw) -> dict:
    """A real export of one enabled rms_norm kernel (and an rmsnorm_linear one unless `single`)."""
    db = tmp / "source.db"
    reg = open_registry(db)
    with reg.write() as s:
        add_kernel(s, result(hidden=HIDDEN, dtype="float32", **kw))
    reg.close()
    out = tmp / "source.json"
    assert cli("export", str(out), "--registry", str(db)).exit_code == 0
    return json.loads(out.read_text())


def import_doc(tmp: Path, doc: dict | str, name: str = "target"):
    """Import `doc` (a dict, or raw JSON text) into a fresh registry; (CLI result, registry path)."""
    path = tmp / f"{name}.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    db = tmp / f"{name}.db"
    return cli("import", str(path), "--registry", str(db)), db


def stored_rows(db: Path) -> list[dict]:
    if not db.exists():
        return []
    got = cli("list", "--registry", str(db), "--json")
    assert got.exit_code == 0, got.output
    return json.loads(got.output)


def block_node(doc: dict, name: str, record: int = 0) -> dict:
    nodes = doc["records"][record]["sgraph"]["json"]["kernels"][0]["nodes"]
    return next(n for n in nodes if n["name"] == name)


__all__ = ["block_node", "cli", "export_doc", "import_doc", "stored_rows"]
