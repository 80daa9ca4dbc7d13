"""Which registry device this process runs on, and the torch device type its kernels use."""

from __future__ import annotations

import platform

from prism_serve.registry.store import DeviceInfo


def current_device(use_vllm: bool = True) -> tuple[DeviceInfo, str]:
    """(fingerprint, torch device type). Inside vLLM the platform is asked (NVML, no CUDA
    context: forked workers stay safe); elsewhere torch. An unknown GPU raises SGraphError."""
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
        return DeviceInfo.from_spec(get_gpu(torch.cuda.get_device_name())), "cuda"
    return DeviceInfo.cpu(platform.machine()), "cpu"
