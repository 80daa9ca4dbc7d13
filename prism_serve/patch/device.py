"""Which registry device this process runs on, and the torch device type its kernels use."""

from __future__ import annotations

import platform

from prism_serve.registry.store import DeviceInfo


def current_device(use_vllm: bool = True, *, measure: bool = False,
                   registry: str | None = None) -> tuple[DeviceInfo, str]:
    """(fingerprint, torch device type). Inside vLLM the platform is asked (NVML, no CUDA
    context: forked workers stay safe) and the GPU is the device row warmup stored for it in
    `registry` (default: the configured one), see `served_gpu`; elsewhere torch. With `measure`
    (warmup), a GPU's spec comes from its driver and a few seconds of microbenchmark and travels
    with the fingerprint; without (the doctor, benchmarks), the GPU is found as the plugin finds it
    (`served_gpu`), so a GPU the known table lacks is reported on too."""
    if use_vllm:
        kind, gpu = vllm_platform()
        if kind == "cpu":
            return DeviceInfo.cpu(platform.machine()), "cpu"
        if gpu is not None:
            return served_gpu(*gpu, registry), "cuda"
        raise ValueError(f"vLLM platform {kind!r} has no prism kernels")
    import torch
    if torch.cuda.is_available():
        if measure:
            from prism_serve.optimize.instantiate.devbench import measured_spec
            return DeviceInfo.from_spec(measured_spec(), measured=True), "cuda"
        return served_gpu(torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()), registry), "cuda"
    return DeviceInfo.cpu(platform.machine()), "cpu"


def vllm_platform() -> tuple[str, tuple[str, tuple[int, int]] | None]:
    """The device query inside vLLM: its platform ("cpu", "cuda", ...) and, on CUDA, the driver's
    name of GPU 0 and its compute capability (vLLM asks NVML; no CUDA context is created)."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        return "cpu", None
    if not current_platform.is_cuda():
        return str(current_platform.device_name), None
    cap = current_platform.get_device_capability(0)
    return "cuda", (current_platform.get_device_name(0), (int(cap.major), int(cap.minor)))


def served_gpu(device_name: str, capability: tuple[int, int], registry: str | None = None) -> DeviceInfo:
    """The registry device of the GPU the driver calls `device_name`: the row warmup stored for
    it (its fingerprint, and the spec measured there), found by canonical name and compute
    capability, so a GPU the known table lacks is served too. Without a row (nothing was warmed
    on this kind of GPU): the known table's spec, else a fingerprint of name and capability with
    no SM count, which no kernel matches. torch is not asked: its device query creates a CUDA
    context, which vLLM's API server must not hold."""
    from prism_serve.optimize.target.gpus import GPUS, canonical_name
    from prism_serve.registry.db import open_registry, resolve_url
    from prism_serve.registry.store import stored_gpu

    name, cc = canonical_name(device_name), f"{capability[0]}.{capability[1]}"
    found = None
    try:
        reg = open_registry(resolve_url(registry), readonly=True)
        try:
            with reg.read() as session:
                found = stored_gpu(session, name, cc)
        finally:
            reg.close()
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - no usable registry or row: the plugin's own read says why
        found = None
    if found is not None:
        return found
    if name in GPUS:
        return DeviceInfo.from_spec(GPUS[name])
    return DeviceInfo("gpu", name, cc)

