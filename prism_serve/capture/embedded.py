"""Tiny model configs shipped with the package, so capture and warmup run with no download.

Each is a directory holding only a Hugging Face `config.json` (no weights: vLLM
uses dummy weights). 2 layers, hidden 128, head_dim 32 (the smallest head size
vLLM's CPU attention accepts), so vLLM starts in seconds on two cores.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
EMBEDDED = ("tiny-llama", "tiny-qwen3")
DEFAULT_MODEL = "tiny-llama"


def embedded_path(name: str) -> Path:
    return MODELS_DIR / name


def resolve_model(model: str | Path | None) -> Path:
    """None -> the default embedded model; an embedded name -> its directory; else the path itself."""
    if model is None:
        return embedded_path(DEFAULT_MODEL)
    if isinstance(model, str) and model in EMBEDDED and not Path(model).exists():
        return embedded_path(model)
    return Path(model).expanduser()
