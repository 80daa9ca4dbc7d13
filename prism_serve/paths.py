"""Where prism-serve keeps its files: the per-user cache and the default registry."""

from __future__ import annotations

import os
from pathlib import Path


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
