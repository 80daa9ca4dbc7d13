"""Where prism-serve keeps its files: the per-user cache and the default registry."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prism_serve.errors import PrismError


def cache_dir() -> Path:
    """$PRISM_SERVE_CACHE, else $XDG_CACHE_HOME/prism-serve, else ~/.cache/prism-serve."""
    if os.environ.get("PRISM_SERVE_CACHE"):
        return Path(os.environ["PRISM_SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prism-serve"


def registry_url() -> str:
    """$PRISM_SERVE_REGISTRY (a path or any SQLAlchemy URL), else a SQLite file in the cache."""
    configured = os.environ.get("PRISM_SERVE_REGISTRY")
    if configured:
        return configured if "://" in configured else f"sqlite:///{Path(configured).expanduser().resolve()}"
    return f"sqlite:///{cache_dir() / 'registry.sqlite'}"


def check_writable(path: Path, what: str, *, make_folders: bool = False) -> None:
    """PrismError unless `path` can be written: an existing file opened for appending, or a new one
    in a folder where a file can be made (its nearest existing ancestor where `make_folders`: the
    writer makes the folders between). Tried, not judged by permission bits, which root ignores.
    Long commands ask this first, so a typo in an output path costs no capture or search."""
    path = Path(path).expanduser().absolute()
    try:
        if path.exists():
            if not path.is_file():
                raise PrismError(f"cannot write the {what} at {path}: it is not a file")
            with path.open("ab"):
                return
        folder = path.parent
        while make_folders and not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise PrismError(f"cannot write the {what} at {path}: there is no folder {folder}")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise PrismError(f"cannot write the {what} at {path}: {exc.strerror or exc}") from None
