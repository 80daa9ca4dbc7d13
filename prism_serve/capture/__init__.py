"""Capture: run a model under vLLM, find its fusable hot regions, turn them into Programs."""

from prism_serve.capture.runner import CaptureError, CaptureResult, Region, buckets_from_histogram, capture

__all__ = ["CaptureError", "CaptureResult", "Region", "buckets_from_histogram", "capture"]
