"""Where the registry lives, and that what it stores is data from which Triton source is regenerated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prism_serve.optimize.codegen.render import render
from prism_serve.registry import RegistryError, load_device, open_registry, resolve_url
from prism_serve.registry.models import Base
from prism_serve.registry.store import DeviceInfo, add_kernel, kernel_instance
from tests.registry.factory import DEVICES, VERSIONS, result


def test_default_is_a_sqlite_file_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PRISM_SERVE_REGISTRY", raising=False)
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    url = resolve_url()
    assert url.startswith("sqlite:///") and url.endswith(".sqlite") and str(tmp_path / "cache") in url
    open_registry().close()
    assert Path(url.removeprefix("sqlite:///")).exists()


def test_environment_and_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", str(tmp_path / "env.db"))
    assert resolve_url() == f"sqlite:///{tmp_path / 'env.db'}"
    assert resolve_url(tmp_path / "arg.db") == f"sqlite:///{tmp_path / 'arg.db'}"
    assert resolve_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"


def test_bad_url_is_a_clear_error():
    with pytest.raises(RegistryError, match="registry"):
        open_registry("nosuchdialect://x/y")


def test_only_data_columns_hold_long_text():
    """The long-text columns are the IR and sGraph JSON (validated on import) and a reason; no source."""
    from sqlalchemy import Text
    long_text = {f"{t.name}.{c.name}" for t in Base.metadata.tables.values() for c in t.columns
                 if isinstance(c.type, Text)}
    assert long_text == {"programs.ir_json", "sgraphs.sgraph_json", "kernels.reason"}


def test_triton_source_is_regenerated_from_stored_data(tmp_path):
    reg = open_registry(tmp_path / "r.db")
    with reg.write() as s:
        add_kernel(s, result(workload="rmsnorm_linear", hidden=256))
        add_kernel(s, result(device=DEVICES[4]))  # the CPU: no GPU spec of its own
    with reg.read() as s:
        (k,) = load_device(s, DEVICES[1], VERSIONS).usable
        (cpu,) = load_device(s, DEVICES[4], VERSIONS).usable
    reg.close()
    source = render(kernel_instance(k))
    assert "@triton.jit" in source and "rmsnorm_linear" in source
    with pytest.raises(RegistryError, match="cannot instantiate"):
        kernel_instance(cpu)


def test_a_measured_device_spec_is_stored_and_used_for_its_kernels(tmp_path):
    """A GPU the known table lacks: its measured spec is stored with its row (typed JSON) and
    instantiates its kernels; a stored spec that fails the checks is a clear registry error."""
    from prism_serve.optimize.target.gpus import GPUS
    from prism_serve.registry.store import device_spec, get_kernel

    spec = dataclasses.replace(GPUS["h100"], name="rtx-pro-6000", sms=188, mem_bandwidth_gbs=1700.0,
                               source="driver (test)")
    device = DeviceInfo.from_spec(spec, measured=True)
    reg = open_registry(tmp_path / "r.db")
    with reg.write() as s:
        kid = add_kernel(s, result(device=device))
    with reg.read() as s:
        k = get_kernel(s, kid)
        assert device_spec(k.device) == spec
        assert kernel_instance(k).gpu == "rtx-pro-6000"
    with reg.write() as s:
        get_kernel(s, kid).device.spec = spec.to_json() | {"sms": -3}
    with reg.read() as s:
        with pytest.raises(RegistryError, match="non-positive"):
            device_spec(get_kernel(s, kid).device)
    reg.close()
