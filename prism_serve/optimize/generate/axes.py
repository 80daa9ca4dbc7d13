"""Grid axes: an index label, or a joint axis over labels that share no tensor, and the maps a
tensor's own labels give under a grid (`design.py` and `split.py` both build with them)."""

from __future__ import annotations

import functools


JOINT = "."  # joins the labels of a joint grid axis: index labels are identifiers (`labels.py`)


@functools.lru_cache(maxsize=4096)
def axis_labels(axis: str) -> tuple[str, ...]:
    """The index labels a grid axis partitions: its own, or each of a joint axis' (``q1.k1``: one
    axis over q's heads and k's heads, whose blocks hold a slice of each, so that what they share,
    rotary's cos / sin rows, is loaded once for both)."""
    return tuple(axis.split(JOINT))


def joint_axis(labels) -> str:
    """The grid axis that partitions each of `labels` (two or more labels that share no tensor)."""
    return JOINT.join(labels)


@functools.lru_cache(maxsize=4096)
def grid_labels(grid: tuple[str, ...]) -> frozenset[str]:
    """The index labels the grid's axes partition."""
    return frozenset(lb for axis in grid for lb in axis_labels(axis))


def _axis_dim(labels: tuple, axis: str) -> int | None:
    return next((labels.index(lb) for lb in axis_labels(axis) if lb in labels), None)


def own_maps(labels: tuple, grid: tuple[str, ...], loop: str | None) -> tuple[tuple[int | None, ...], int | None]:
    """The maps the tensor's index labels give: each grid axis partitions the dim with its label
    (with one of a joint axis' labels; replicated where the tensor has none), the loop walks the
    dim with the loop label."""
    return (tuple(_axis_dim(labels, axis) for axis in grid),
            labels.index(loop) if loop is not None and loop in labels else None)
