"""A few seconds of microbenchmark that give the cost model this device's own figures:
DRAM bandwidth (a large copy) and launch latency, eager and under CUDA-graph replay.

The measuring is behind `Probe` so the arithmetic is tested on any machine with an injected
probe; `CudaProbe` is the real one (torch + Triton on a GPU).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Protocol

from prism_serve.errors import PrismError

COPY_BYTES = 256 * 2**20  # several times any L2 (the largest known, B200's, is about 126 MB)
LAUNCH_COUNTS = (20, 200)  # launch latency is the slope between these, so fixed costs cancel


class Probe(Protocol):
    def copy_us(self, nbytes: int) -> float:
        """Time of one device-to-device copy of `nbytes` (reads and writes them once)."""

    def eager_us(self, launches: int) -> float:
        """Host wall time of `launches` back-to-back launches of an empty kernel, synchronised."""

    def graph_us(self, launches: int) -> float:
        """Device time of replaying one CUDA graph holding `launches` empty kernels."""


@dataclass(frozen=True)
class DeviceFigures:
    bandwidth_gbs: float
    eager_launch_us: float
    graph_launch_us: float


def _slope(timed, counts: tuple[int, int]) -> float:
    lo, hi = counts
    per = (timed(hi) - timed(lo)) / (hi - lo)
    if not per > 0:
        raise PrismError(f"launch timing did not grow with launches ({timed(lo):.1f} us for {lo}, "
                         f"{timed(hi):.1f} us for {hi}): the device or its clock misbehaves")
    return per


def measure(probe: Probe, *, copy_bytes: int = COPY_BYTES, reps: int = 5) -> DeviceFigures:
    """Bandwidth from the median of `reps` copies (2 x bytes moved), launch latencies from the
    slope of time over launch count (median of `reps`)."""
    copy = statistics.median(probe.copy_us(copy_bytes) for _ in range(reps))
    if copy <= 0:
        raise PrismError(f"a copy of {copy_bytes} bytes timed {copy} us")
    eager = _slope(lambda n: statistics.median(probe.eager_us(n) for _ in range(reps)), LAUNCH_COUNTS)
    graph = _slope(lambda n: statistics.median(probe.graph_us(n) for _ in range(reps)), LAUNCH_COUNTS)
    return DeviceFigures(2 * copy_bytes / copy / 1e3, eager, graph)


class CudaProbe:
    """The real probe: torch's copy, an empty Triton kernel, a captured CUDA graph."""

    def __init__(self, device: str = "cuda"):
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def _empty(x_ptr):
            tl.store(x_ptr + tl.program_id(0), 0.0)

        self.torch, self.kernel = torch, _empty
        self.flag = torch.zeros(1, device=device)
        self.src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.kernel[(1,)](self.flag)  # compile once, outside any timing
        self.graphs: dict[int, object] = {}

    def _events(self, fn) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def copy_us(self, nbytes: int) -> float:
        return self._events(lambda: self.dst[:nbytes].copy_(self.src[:nbytes]))

    def eager_us(self, launches: int) -> float:
        self.torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(launches):
            self.kernel[(1,)](self.flag)
        self.torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6

    def graph_us(self, launches: int) -> float:
        torch = self.torch
        if launches not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(launches):
                        self.kernel[(1,)](self.flag)
            self.graphs[launches] = graph
        return self._events(self.graphs[launches].replay)


def measured_spec(device: int = 0):
    """This GPU's spec: the driver's properties plus measured bandwidth and launch latencies."""
    import torch

    from prism_serve.optimize.target.gpus import spec_from_device

    with torch.cuda.device(device):
        figures = measure(CudaProbe(f"cuda:{device}"))
    return spec_from_device(torch.cuda.get_device_properties(device), bandwidth_gbs=figures.bandwidth_gbs,
                            eager_launch_us=figures.eager_launch_us, graph_launch_us=figures.graph_launch_us)
