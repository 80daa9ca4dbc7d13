"""Output paths are tried before long work: a file that can be written, or a folder to make it in."""

from __future__ import annotations

import pytest

from prism_serve.errors import PrismError
from prism_serve.paths import check_writable
from prism_serve.registry import RegistryError, open_registry
from prism_serve.registry.db import check_registry_writable


def test_a_new_or_existing_file_in_a_writable_folder_passes_and_nothing_is_made(tmp_path):
    check_writable(tmp_path / "new.json", "report")
    (tmp_path / "old.json").write_text("kept")
    check_writable(tmp_path / "old.json", "report")
    check_writable(tmp_path / "a" / "b" / "r.db", "registry", make_folders=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "kept"


@pytest.mark.parametrize("case", ["folder", "missing folder", "under a file", "proc"])
def test_what_cannot_be_written_is_named_in_one_error(case, tmp_path):
    (tmp_path / "f").write_text("")
    path, needle = {"folder": (tmp_path, "it is not a file"),
                    "missing folder": (tmp_path / "x" / "r.json", f"there is no folder {tmp_path / 'x'}"),
                    "under a file": (tmp_path / "f" / "r.json", "cannot write"),
                    "proc": ("/proc/prism-serve-test/r.json", "cannot write")}[case]
    with pytest.raises(PrismError, match="cannot write the report at") as err:
        check_writable(path, "report")
    assert needle in str(err.value)


def test_a_registry_is_checked_before_it_is_made(tmp_path):
    with pytest.raises(RegistryError, match="cannot write the registry at /proc"):
        check_registry_writable("/proc/prism-serve-test/r.db")
    with pytest.raises(RegistryError, match="cannot write the registry"):
        open_registry("/proc/prism-serve-test/r.db")  # once a FileNotFoundError traceback
    check_registry_writable(tmp_path / "sub" / "r.db")
    check_registry_writable("postgresql://user@nowhere/db")  # other databases are checked when opened


def test_warmup_refuses_an_unwritable_registry_before_capturing(tmp_path, monkeypatch):
    from prism_serve.capture import runner
    from prism_serve.warmup import warmup

    def no_capture(*_a):
        raise AssertionError("captured before checking the registry")

    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "capture", no_capture)
    with pytest.raises(RegistryError, match="cannot write the registry at /proc"):
        warmup(None, registry="/proc/prism-serve-test/r.db")
