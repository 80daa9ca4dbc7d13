"""Capture: run a model under vLLM, find its fusable hot regions, turn them into Programs."""

__all__ = ["CaptureError", "CaptureResult", "Region", "buckets_from_histogram", "capture"]


def __getattr__(name: str):
    """Load the runner (and torch with it) on first use, so `prism-serve --help` stays fast."""
    if name in __all__:
        from prism_serve.capture import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'prism_serve.capture' has no attribute {name!r}")
