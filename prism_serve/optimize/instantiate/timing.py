"""Timing of kernels: median of many runs after warm-up, inputs rotated so caches flatter no one.

On a GPU the clock is CUDA events; on the CPU (the interpreter) it is perf_counter, which
proves the path only: interpreter times say nothing about GPU speed.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

Timer = Callable[..., float]  # (instance, num_tokens) -> microseconds


def median_us(fn: Callable[..., object], input_sets: Sequence[Sequence[torch.Tensor]], *,
              warmup: int = 5, reps: int = 50) -> float:
    """Median time of `fn(*inputs)` in microseconds, cycling through `input_sets`."""
    on_gpu = bool(input_sets) and input_sets[0][0].is_cuda
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    samples = []
    if on_gpu:
        torch.cuda.synchronize()
        for i in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*input_sets[i % len(input_sets)])
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for i in range(reps):
            start = time.perf_counter()
            fn(*input_sets[i % len(input_sets)])
            samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def graph_us(fn: Callable[..., object], input_sets: Sequence[Sequence[torch.Tensor]], *,
             warmup: int = 3, reps: int = 20, min_calls: int = 16) -> float:
    """Device time per call of `fn(*inputs)` in microseconds under CUDA-graph replay, as vLLM runs
    decode: one graph holds one call per input set (cycled to at least `min_calls`), so host launch
    cost is gone and what remains is the kernels and the gaps between graph nodes. Median of
    `reps` replays, divided by the calls in the graph. GPU only; warm-up compiles outside capture."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    calls = max(min_calls, len(input_sets))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def rotation(make_inputs: Callable[[int], list[torch.Tensor]], bytes_per_set: int,
             l2_bytes: int, max_sets: int = 16) -> list[list[torch.Tensor]]:
    """Enough independent input sets that cycling through them exceeds the L2 cache."""
    count = max(2, min(max_sets, -(-2 * l2_bytes // max(bytes_per_set, 1))))
    return [make_inputs(seed) for seed in range(count)]


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None with fewer than 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(list(xs)), ranks(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def cuda_timer(prog, gpu, *, warmup: int = 10, reps: int = 100) -> Timer:
    """A timer for `tune.measure`: the generated kernel of an instance on the GPU, median of `reps`
    runs over input sets rotated past the L2."""
    from prism_serve.optimize.codegen.render import compile_instance
    from prism_serve.optimize.ir.reference import random_inputs

    def timer(inst, num_tokens: int) -> float:
        first = random_inputs(prog, num_tokens, seed=0)
        nbytes = sum(t.numel() * t.element_size() for t in first)
        sets = rotation(lambda s: random_inputs(prog, num_tokens, seed=s, device="cuda"), nbytes,
                        int(gpu.l2_mb * 2**20))
        return median_us(compile_instance(inst), sets, warmup=warmup, reps=reps)

    return timer
