"""Kernels that misbehave, in this process (no vLLM): a load that raises SystemExit, ends its
process or hangs is refused within the bound while the other kernels serve; a kernel that raises
SystemExit when called falls back to vLLM's path for good; the plugin says each refusal in one
line and never raises into vLLM."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from prism_serve.patch import ops, plugin, table
from prism_serve.patch.device import current_device
from prism_serve.registry import open_registry
from prism_serve.registry.store import load_device

EPS = 1e-6


def _kernels(url):
    reg = open_registry(url, readonly=True)
    with reg.read() as s:
        kernels = load_device(s, current_device(use_vllm=False)[0], statuses=("verified",)).usable
    reg.close()
    return kernels


def _misbehaving(bad: dict):
    """`table._prepare`, except for the kernels in `bad` (id -> what they do instead)."""
    real = table._prepare

    def prepare(k, spec):
        what = bad.get(k.id)
        if what == "exit":
            exit(3)
        if what == "os._exit":
            os._exit(5)
        if what == "hang":
            time.sleep(3600)
        return real(k, spec)
    return prepare


@pytest.fixture
def live():
    rt = ops.open_runtime()
    yield rt
    rt.close()


def test_bad_loads_are_refused_within_the_bound_and_the_rest_serve(kernels_registry, monkeypatch, live):
    kernels = _kernels(kernels_registry)
    norm = sorted((k for k in kernels if k.program.name == "rms_norm" and "128" in k.program.ir_json),
                  key=lambda k: k.bucket_lo)
    silu = sorted((k for k in kernels if k.program.name == "silu_and_mul"), key=lambda k: k.bucket_lo)
    fused = [k for k in kernels if k.program.name == "fused_add_rms_norm"]
    bad = {norm[0].id: "exit", silu[1].id: "os._exit", fused[0].id: "hang"}
    monkeypatch.setattr(table, "_prepare", _misbehaving(bad))
    start = time.monotonic()
    t = table.build_table(kernels, "cpu", timeout_s=2.0)
    assert time.monotonic() - start < 30  # the hang cost its bound, not an hour
    assert dict(t.refused) == {norm[0].id: "SystemExit: 3",
                               silu[1].id: "ended the loading process (exit status 5)",
                               fused[0].id: "took longer than 2 s to load"}
    assert {kid for kid, why in t.skipped} == set(bad)
    live.table = t
    gen = torch.Generator().manual_seed(0)
    w = 1 + 0.1 * torch.randn(128, generator=gen)
    for rows, served in ((3, False), (12, True)):  # bucket 1-8 of the norm was refused, 9-8192 serves
        x = torch.randn(rows, 128, generator=gen)
        kernel, miss = live.counts["rms_norm"], live.misses["rms_norm"]
        torch.testing.assert_close(torch.ops.prism.rms_norm(x, w, EPS), ops.ref_rms_norm(x, w, EPS))
        assert (live.counts["rms_norm"] - kernel, live.misses["rms_norm"] - miss) == ((1, 0) if served else (0, 1))


def test_a_kernel_that_raises_system_exit_when_called_falls_back_for_good(kernels_registry, live, caplog):
    t = table.build_table(_kernels(kernels_registry), "cpu")
    buckets = t.entry("silu_and_mul", torch.float32, 256)
    launcher = buckets.pick(4)

    def payload(*args):
        exit(3)
    launcher.run = payload
    live.table = t
    x = torch.randn(4, 512)
    before = (live.counts["silu_and_mul"], live.misses["silu_and_mul"])
    with caplog.at_level(logging.WARNING, logger="vllm.prism_serve.ops"):
        for _ in range(3):
            torch.testing.assert_close(torch.ops.prism.silu_and_mul(x), ops.ref_silu_and_mul(x))
    assert (live.counts["silu_and_mul"] - before[0], live.misses["silu_and_mul"] - before[1]) == (0, 3)
    lines = [r.getMessage() for r in caplog.records if "prism-serve:" in r.getMessage()]
    assert len(lines) == 1 and f"kernel {launcher.kernel_id} for silu_and_mul failed (SystemExit: 3)" in lines[0]
    assert launcher.kernel_id in live.failed


@pytest.fixture
def fresh_plugin(monkeypatch, kernels_registry):
    """The plugin as vLLM starts it, on this device's registry, without importing vLLM."""
    monkeypatch.setattr("prism_serve.patch.device.current_device", lambda: current_device(use_vllm=False))
    monkeypatch.setattr(plugin, "_logging_ready", lambda: None)
    monkeypatch.setenv("PRISM_SERVE_REGISTRY", kernels_registry)
    monkeypatch.setenv("PRISM_SERVE_FORCE", "1")
    plugin.unpatch()
    yield
    plugin.unpatch()


def test_the_plugin_logs_one_line_per_refused_kernel(fresh_plugin, kernels_registry, monkeypatch, caplog):
    kernels = _kernels(kernels_registry)
    monkeypatch.setattr(table, "_prepare", _misbehaving({k.id: "exit" for k in kernels}))
    with caplog.at_level(logging.INFO, logger="vllm.prism_serve"):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if "prism-serve:" in r.getMessage()]
    refusals = [line for line in lines if "refused kernel" in line]
    assert sorted(refusals) == sorted(f"prism-serve: refused kernel {k.id}: SystemExit: 3; vLLM's own path serves "
                                      f"its shapes" for k in kernels)
    assert len(lines) == len(kernels) + 1 and "nothing patched" in lines[-1]
    assert plugin.STATUS.state == "nothing" and not plugin.STATUS.patched


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), MemoryError()])
def test_the_plugin_never_raises_into_vllm(fresh_plugin, monkeypatch, caplog, exc):
    def plan():
        raise exc
    monkeypatch.setattr(plugin, "plan", plan)
    with caplog.at_level(logging.INFO, logger="vllm.prism_serve"):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if "prism-serve:" in r.getMessage()]
    assert plugin.STATUS.state == "error" and lines == [plugin.STATUS.message]
    assert lines[0].startswith(f"prism-serve: nothing patched, the plugin failed: {type(exc).__name__}")


def test_keyboard_interrupt_still_stops_start_up(fresh_plugin, monkeypatch):
    def plan():
        raise KeyboardInterrupt
    monkeypatch.setattr(plugin, "plan", plan)
    with pytest.raises(KeyboardInterrupt):
        plugin.register()


def test_a_row_with_a_damaged_bucket_is_refused_alone(kernels_registry, live):
    """A registry cell edited by hand (SQLite keeps a string in an integer column) refuses that
    kernel, in one line, while every other kernel serves."""
    import sqlite3

    from prism_serve.registry.db import sqlite_file

    kernels = _kernels(kernels_registry)
    victim = next(k for k in kernels if k.program.name == "silu_and_mul")
    db = sqlite3.connect(sqlite_file(kernels_registry))
    try:
        db.execute("UPDATE kernels SET bucket_lo = 'abc' WHERE id = ?", (victim.id,))
        db.commit()
        t = table.build_table(_kernels(kernels_registry), "cpu")
    finally:
        db.execute("UPDATE kernels SET bucket_lo = ? WHERE id = ?", (victim.bucket_lo, victim.id))
        db.commit()
        db.close()
    assert dict(t.refused) == {victim.id: "its bucket 'abc'-" + f"{victim.bucket_hi!r} is not 1 <= lo <= hi"}
    assert {kid for kid, _ in t.skipped} == {victim.id}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul"} <= set(t.ops)  # its other buckets serve


def test_a_row_whose_stored_json_is_damaged_is_skipped_alone(kernels_registry, tmp_path):
    """A JSON cell that no longer decodes (an sGraph's proof edited by hand) fails only the kernels
    that read it: the plugin names them and serves the others."""
    import shutil
    import sqlite3

    from prism_serve.registry.db import sqlite_file

    db = tmp_path / "r.db"
    shutil.copy(sqlite_file(kernels_registry), db)
    con = sqlite3.connect(db)
    victim = con.execute("SELECT id FROM sgraphs WHERE id = (SELECT min(sgraph_id) FROM kernels)").fetchone()[0]
    damaged = {kid for (kid,) in con.execute("SELECT id FROM kernels WHERE sgraph_id = ?", (victim,))}
    con.execute("UPDATE sgraphs SET proof = '{not json' WHERE id = ?", (victim,))
    con.commit()
    con.close()
    p = plugin.plan(f"sqlite:///{db}", force=True)
    assert p.state == "ready", p.message
    named = {why for why in p.reasons if "damaged row" in why}
    assert {int(why.split()[1].rstrip(":")) for why in named} == damaged
    assert sum(p.reasons.values()) >= len(damaged) and p.table.ops
