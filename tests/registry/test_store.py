"""The store API, run against SQLite and a real PostgreSQL server."""

from __future__ import annotations

import dataclasses

import pytest

from prism_serve.registry import RegistryError, best_kernel, load_device
from prism_serve.registry.exchange import export_document, import_results, parse_export
from prism_serve.registry.store import (
    add_kernel,
    counts,
    decode_params,
    decode_sgraph,
    explain,
    finish_warmup,
    gc,
    get_kernel,
    list_kernels,
    remove_kernels,
    set_status,
    start_warmup,
)
from tests.registry.factory import DEVICES, VERSIONS, result

H200 = DEVICES[1]


def test_upsert_is_idempotent(registry):
    r = result()
    with registry.write() as s:
        first = add_kernel(s, r)
    with registry.write() as s:
        second = add_kernel(s, dataclasses.replace(r, measured_us=5.0, reason="remeasured"))
    assert first == second
    with registry.read() as s:
        assert counts(s) | {"warmup_runs": 0} == {"devices": 1, "programs": 1, "program_sources": 1, "sgraphs": 1,
                                                  "kernels": 1, "warmup_runs": 0}
        k = get_kernel(s, first)
        assert (k.measured_us, k.reason, k.speedup) == (5.0, "remeasured", 4.0)


def test_best_kernel_picks_fastest_enabled_in_bucket(registry):
    with registry.write() as s:
        add_kernel(s, result(bucket=(1, 16), measured_us=9.0))
        fast = add_kernel(s, result(bucket=(1, 16), measured_us=3.0, params={"BT": 8}))
        add_kernel(s, result(bucket=(1, 16), measured_us=1.0, params={"BT": 4}, status="disabled"))
        big = add_kernel(s, result(bucket=(17, 256), measured_us=30.0))
        add_kernel(s, result(bucket=(1, 16), measured_us=0.5, dtype="bfloat16"))
        add_kernel(s, result(bucket=(1, 16), measured_us=0.5, device=DEVICES[0]))
    h = result().program.canonical_hash
    with registry.read() as s:
        assert best_kernel(s, h, "float16", H200, 7).id == fast
        assert best_kernel(s, h, "float16", H200.fingerprint, 16).id == fast
        assert best_kernel(s, h, "float16", H200, 17).id == big
        assert best_kernel(s, h, "float16", H200, 257) is None
        assert best_kernel(s, h, "float32", H200, 7) is None
        assert best_kernel(s, "0" * 32, "float16", H200, 7) is None


def test_load_device_skips_incompatible_with_reason(registry):
    old = dataclasses.replace(VERSIONS, codegen=VERSIONS.codegen - 1)
    with registry.write() as s:
        for lo in range(1, 40, 4):
            add_kernel(s, result(bucket=(lo, lo + 3)))
        add_kernel(s, result(hidden=2048, versions=old))
        add_kernel(s, result(hidden=4096, versions=dataclasses.replace(VERSIONS, triton="3.6.0")))
        add_kernel(s, result(device=DEVICES[0]))
        add_kernel(s, result(hidden=512, status="verified"))
    with registry.read() as s:
        got = load_device(s, H200, VERSIONS)
        reasons = explain(s, H200, VERSIONS)
    assert len(got.usable) == 10 and all(k.device.fingerprint == H200.fingerprint for k in got.usable)
    assert sorted(why for _, why in got.skipped) == ["built with triton 3.6.0, running 3.8.0",
                                                     f"codegen version {old.codegen} != running {VERSIONS.codegen}"]
    assert reasons["loaded"] == 10 and reasons["status verified"] == 1
    assert reasons[f"for another device ({DEVICES[0].fingerprint})"] == 1
    k = got.usable[0]  # detached objects stay readable; the sGraph is rebuilt from data
    assert decode_sgraph(k).name == "rms_norm_oracle" and decode_params(k) == {"BT": 16}


def test_list_filter_status_remove_gc(registry):
    with registry.write() as s:
        a = add_kernel(s, result())
        b = add_kernel(s, result(workload="swiglu", hidden=256))
        add_kernel(s, result(device=DEVICES[0]))
    with registry.read() as s:
        assert len(list_kernels(s)) == 3
        assert [k.id for k in list_kernels(s, program="swiglu")] == [b]
        assert len(list_kernels(s, device="h200")) == 2
    with registry.write() as s:
        set_status(s, a, "disabled", "slower than vllm at this size")
    with registry.read() as s:
        assert [k.id for k in list_kernels(s, status="disabled")] == [a]
    with registry.write() as s:
        assert remove_kernels(s, [b]) == 1
        removed = gc(s)
    assert removed == {"sgraphs": 1, "programs": 1, "devices": 0}
    with registry.read() as s:
        assert counts(s)["programs"] == 1
    with pytest.raises(RegistryError, match="no kernel with id"), registry.write() as s:
        set_status(s, 999, "enabled", "")


def test_warmup_run_record(registry):
    with registry.write() as s:
        run = start_warmup(s, "tiny-llama", H200)
        add_kernel(s, result(warmup_run_id=run))
        finish_warmup(s, run, "ok", {"kernels": 1})
    with registry.read() as s:
        assert counts(s)["warmup_runs"] == 1
        assert list_kernels(s)[0].warmup_run_id == run


def test_export_import_round_trip(registry, tmp_path):
    from prism_serve.registry.db import open_registry
    with registry.write() as s:
        add_kernel(s, result())
        add_kernel(s, result(workload="rmsnorm_linear", hidden=256, bucket=(17, 64)))
    with registry.read() as s:
        doc = export_document(s)
    other = open_registry(tmp_path / "other.db")
    with other.write() as s:
        assert import_results(s, parse_export(doc)) == 2
    with other.read() as s:
        assert export_document(s)["records"] == doc["records"]
    with registry.write() as s:  # importing into the source changes nothing
        import_results(s, parse_export(doc))
    with registry.read() as s:
        assert counts(s)["kernels"] == 2
    other.close()


def test_invalid_result_rejected(registry):
    with pytest.raises(RegistryError, match="params"), registry.write() as s:
        add_kernel(s, result(params={"BT": 0}))
    with pytest.raises(RegistryError, match="bucket"), registry.write() as s:
        add_kernel(s, result(bucket=(16, 1)))
    with registry.read() as s:
        assert counts(s)["kernels"] == 0
