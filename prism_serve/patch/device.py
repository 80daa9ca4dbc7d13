"""Which registry device this process runs on, and the torch device type its kernels use."""

from __future__ import annotations

import platform

from prism_serve.registry.store import DeviceInfo


def current_device(use_vllm: bool = True, *, measure: bool = False) -> tuple[DeviceInfo, str]:
    """(fingerprint, torch device type). Inside vLLM the platform is asked (NVML, no CUDA
    context: forked workers stay safe); elsewhere torch. With `measure` (warmup), a GPU's spec
    comes from its driver and a few seconds of microbenchmark and travels with the fingerprint;
    without, a GPU must be in the known table (else SGraphError)."""
    from prism_serve.optimize.gpus import get_gpu

    if use_vllm:
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            return DeviceInfo.cpu(platform.machine()), "cpu"
        if current_platform.is_cuda():
            return DeviceInfo.from_spec(get_gpu(current_platform.get_device_name(0))), "cuda"
        raise ValueError(f"vLLM platform {current_platform.device_name!r} has no prism kernels")
    import torch
    if torch.cuda.is_available():
        if measure:
            return DeviceInfo.from_spec(measured_spec(), measured=True), "cuda"
        return DeviceInfo.from_spec(get_gpu(torch.cuda.get_device_name())), "cuda"
    return DeviceInfo.cpu(platform.machine()), "cpu"


def measured_spec(device: int = 0):
    """This GPU's spec: the driver's properties plus measured bandwidth and launch latencies."""
    import torch

    from prism_serve.optimize.devbench import CudaProbe, measure
    from prism_serve.optimize.gpus import spec_from_device

    with torch.cuda.device(device):
        figures = measure(CudaProbe(f"cuda:{device}"))
    return spec_from_device(torch.cuda.get_device_properties(device), bandwidth_gbs=figures.bandwidth_gbs,
                            eager_launch_us=figures.eager_launch_us, graph_launch_us=figures.graph_launch_us)
