"""Inside vLLM the GPU is the device row warmup stored for it, so a GPU the known table lacks is
served with the spec measured there. Only the device query (vLLM's platform: name and compute
capability from NVML) is replaced; the registry, the lookup and the plugin's plan are real."""

from __future__ import annotations

import dataclasses

import pytest

from prism_serve.optimize.target.gpus import GPUS, SGraphError, get_gpu
from prism_serve.patch import device as device_mod
from prism_serve.patch.plugin import plan
from prism_serve.registry import open_registry
from prism_serve.registry.store import DeviceInfo, add_kernel, kernel_instance, load_device, stored_gpu
from tests.registry.factory import VERSIONS, result

# An Ada GPU the known table does not hold; warmup measured its spec on the device.
L20 = dataclasses.replace(GPUS["l40s"], name="l20", sms=92, mem_bandwidth_gbs=864.0, l2_mb=96.0,
                          fp16_tensor_tflops=119.5, source="driver (NVIDIA L20); bandwidth and launch measured")


def _query(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(device_mod, "vllm_platform", lambda: ("cuda", (name, capability)))


def test_a_gpu_absent_from_the_known_table_is_served_with_its_stored_spec(tmp_path, monkeypatch):
    with pytest.raises(SGraphError, match="unknown GPU"):
        get_gpu("NVIDIA L20")  # what the plugin used to do with this GPU
    url = f"sqlite:///{tmp_path / 'r.db'}"
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, result(device=DeviceInfo.from_spec(L20, measured=True)))
        add_kernel(s, result(workload="fused_add_rms_norm"))  # an H200 row beside it
    reg.close()
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", url)
    _query(monkeypatch, "NVIDIA L20", (8, 9))

    device, device_type = device_mod.current_device()
    assert device_type == "cuda"
    assert device.fingerprint == "gpu:l20:sm8.9:92sms" and device.spec == L20
    reg = open_registry(url, readonly=True)
    with reg.read() as s:
        (k,) = load_device(s, device, VERSIONS).usable
        assert kernel_instance(k).gpu == "l20"  # instantiated with the stored spec
    reg.close()
    assert plan(url).device == device.fingerprint


def test_the_row_is_matched_by_compute_capability_and_a_known_gpu_without_one_uses_the_table(tmp_path,
                                                                                            monkeypatch):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, result(device=DeviceInfo.from_spec(L20, measured=True)))
    reg.close()
    reg = open_registry(url, readonly=True)
    with reg.read() as s:  # same name, another architecture: not this row
        assert stored_gpu(s, "l20", "9.0") is None and stored_gpu(s, "l20", "8.9").sm_count == 92
    reg.close()
    _query(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    device, _ = device_mod.current_device(registry=url)
    assert device == DeviceInfo.from_spec(GPUS["h100"]) and device.spec is None


def test_of_two_rows_for_one_gpu_the_one_holding_enabled_kernels_is_served(tmp_path):
    """An import (from an H100 with another SM count) adds a second row for the same name and
    capability, holding more kernels, none enabled: the plugin keeps the row whose kernels were
    measured here, not the one with the most kernels."""
    local = DeviceInfo.from_spec(dataclasses.replace(GPUS["h100"], source="driver"), measured=True)
    foreign = DeviceInfo.from_spec(dataclasses.replace(GPUS["h100"], sms=133))
    url = f"sqlite:///{tmp_path / 'r.db'}"
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, result(device=local))
        for workload in ("fused_add_rms_norm", "rmsnorm_linear"):
            add_kernel(s, result(workload=workload, device=foreign, status="verified", measured_us=None))
    reg.close()
    reg = open_registry(url, readonly=True)
    with reg.read() as s:
        assert stored_gpu(s, "h100", "9.0").fingerprint == local.fingerprint
    reg.close()


def test_a_gpu_neither_warmed_nor_known_is_named_without_a_cuda_context(tmp_path, monkeypatch):
    """The plugin runs in vLLM's API server too: there it must not create a CUDA context (torch's
    device query does), so an unknown GPU without a stored row gets a fingerprint no kernel matches."""
    import torch

    def no_context(*_a, **_k):
        raise AssertionError("the plugin asked torch for the device: that creates a CUDA context")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_context)
    _query(monkeypatch, "NVIDIA GeForce RTX 4090", (8, 9))
    device, device_type = device_mod.current_device(registry=f"sqlite:///{tmp_path / 'none.db'}")
    assert device_type == "cuda" and device.fingerprint == "gpu:geforce-rtx-4090:sm8.9:?sms"


def test_the_doctor_finds_the_gpu_as_the_plugin_does(tmp_path, monkeypatch):
    """Outside vLLM (the doctor) a GPU the known table lacks is the row warmup stored for it,
    not an 'unknown GPU' error."""
    import torch

    url = f"sqlite:///{tmp_path / 'r.db'}"
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, result(device=DeviceInfo.from_spec(L20, measured=True)))
    reg.close()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA L20")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))
    device, device_type = device_mod.current_device(use_vllm=False, registry=url)
    assert (device.fingerprint, device.spec, device_type) == ("gpu:l20:sm8.9:92sms", L20, "cuda")
