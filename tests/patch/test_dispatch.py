"""The dispatch table and the prism custom ops, in this process (no vLLM): bucket choice,
what is skipped and why, numerics against vLLM's semantics, misses, fake impls and torch.compile."""

from __future__ import annotations

import json

import pytest
import torch

from prism_serve.optimize.workloads import programs
from prism_serve.patch import ops, runtime, seed
from prism_serve.patch.device import current_device
from prism_serve.patch.table import build_table, disjoint
from prism_serve.registry import add_kernel, open_registry
from prism_serve.registry.store import load_device

from .conftest import fill

EPS = 1e-6
OPS3 = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")


def _table(url, statuses=("verified",)):
    reg = open_registry(url)
    with reg.read() as s:
        loaded = load_device(s, current_device(use_vllm=False)[0], statuses=statuses)
        table = build_table(loaded.usable, "cpu")
    reg.close()
    return table


@pytest.fixture(scope="module")
def table(kernels_registry):
    return _table(kernels_registry)


@pytest.fixture
def live(table):
    rt = ops.open_runtime(table)
    yield rt
    rt.close()


def test_table_serves_each_op_and_bucket(table):
    f32 = torch.float32
    assert set(table.summary()) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul"}
    assert table.entry("rms_norm", f32, 128, EPS) and table.entry("rms_norm", f32, 32, EPS)  # norm and q/k norm
    b = table.entry("silu_and_mul", f32, 256)
    assert (b.los, b.his) == ([1, 9], [8, 8192])
    small, large = b.pick(1), b.pick(9)
    assert small is b.pick(8) and large is b.pick(8192) and small is not large
    assert b.pick(8193) is None and b.pick(0) is None
    assert table.entry("rms_norm", f32, 128, 1e-5) is None  # another epsilon is another program
    assert table.entry("rms_norm", torch.float16, 128, EPS) is None


def test_silu_and_mul_buckets_count_tokens_not_both_halves(live):
    b = live.table.entry("silu_and_mul", torch.float32, 256)
    before = live.counts["silu_and_mul"]
    assert live.pick("silu_and_mul", torch.randn(5, 512), 256, None) is b.pick(5) is not b.pick(10)
    assert live.pick("rms_norm", torch.randn(2, 4, 32), 32, EPS) is live.table.entry("rms_norm", torch.float32, 32,
                                                                                       EPS).pick(8)
    assert live.counts["silu_and_mul"] == before + 1


def test_overlapping_buckets_take_the_fastest(table):
    lz = table.entry("rms_norm", torch.float32, 128, EPS).launchers
    Launcher = type(lz[0])
    fast, slow = Launcher(lz[0].run, 1, 1, 100, measured_us=5.0), Launcher(lz[1].run, 2, 50, 200, measured_us=9.0)
    b = disjoint([slow, fast])
    assert (b.los, b.his) == ([1, 101], [100, 200])
    assert [x.kernel_id for x in b.launchers] == [1, 2]
    # a modeled time is never ranked against a measured one: the measured kernel keeps its range
    modeled = Launcher(lz[0].run, 3, 1, 200, modeled_us=1.0)
    b = disjoint([slow, modeled])
    assert (b.los, b.his, [x.kernel_id for x in b.launchers]) == ([1, 50], [49, 200], [3, 2])


def test_unpatchable_and_broken_kernels_are_skipped_with_reasons(tmp_path):
    device = current_device(use_vllm=False)[0]
    linear = seed.results([programs.rmsnorm_mlp(64, 32, "float32")], device, buckets=(((1, 16), 16),))
    silu = seed.results([programs.silu_and_mul(256, "float32")], device, buckets=(((1, 16), 16),))[0]
    bad = type(silu)(**{**silu.__dict__, "params": {"BT": 16, "G": 3}})  # 256 columns do not split in 3
    url = fill(tmp_path / "r.db", linear + [bad])
    table = _table(url)
    assert not table.ops
    reasons = sorted(why for _, why in table.skipped)
    assert reasons[0].startswith("failed to load: RegistryError") and "cannot instantiate" in reasons[0]
    assert reasons[1] == "program 'rmsnorm_mlp' is not one prism can patch into vLLM"
    assert [why for _, why in table.refused] == [reasons[0].removeprefix("failed to load: ")]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 37])
def test_ops_match_vllm_semantics(live, rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 128, generator=gen), torch.randn(rows, 128, generator=gen)
    w = 1 + 0.1 * torch.randn(128, generator=gen)
    before = dict(live.counts)
    torch.testing.assert_close(torch.ops.prism.rms_norm(x, w, EPS), ops.ref_rms_norm(x, w, EPS))
    y, r = torch.ops.prism.fused_add_rms_norm(x, res, w, EPS)
    ry, rr = ops.ref_fused_add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(r, rr)
    gu = torch.randn(rows, 512, generator=gen)
    torch.testing.assert_close(torch.ops.prism.silu_and_mul(gu), ops.ref_silu_and_mul(gu))
    q = torch.randn(rows, 4, 32, generator=gen)  # q-norm: rows x heads rows of head_dim
    qw = 1 + 0.1 * torch.randn(32, generator=gen)
    torch.testing.assert_close(torch.ops.prism.rms_norm(q, qw, EPS), ops.ref_rms_norm(q, qw, EPS))
    ran = {k: live.counts[k] - before[k] for k in before if live.counts[k] != before[k]}
    assert ran == {"rms_norm": 2, "fused_add_rms_norm": 1, "silu_and_mul": 1}


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_norm_and_projection_region_matches_vllm_semantics(tmp_path, rows):
    device = current_device(use_vllm=False)[0]
    url = fill(tmp_path / "r.db", seed.results([programs.rmsnorm_linear(128, 96, "float32")], device))
    rt = ops.open_runtime(_table(url))
    try:
        gen = torch.Generator().manual_seed(rows)
        x, g, w = torch.randn(rows, 128, generator=gen), 1 + 0.1 * torch.randn(128, generator=gen), \
            torch.randn(96, 128, generator=gen) / 128 ** 0.5
        before = rt.counts["rmsnorm_linear"]
        got = torch.ops.prism.rmsnorm_linear(x, g, w, EPS, -1)
        torch.testing.assert_close(got, ops.reference("rmsnorm_linear")(x, g, w, EPS, -1))
        assert rt.counts["rmsnorm_linear"] == before + 1
        misses = rt.misses["rmsnorm_linear"]
        torch.ops.prism.rmsnorm_linear(x, g, w[:64], EPS, -1)  # another projection size: vLLM's path
        assert rt.misses["rmsnorm_linear"] == misses + 1
    finally:
        rt.close()


def test_a_miss_falls_back_to_vllms_path(live, monkeypatch):
    """A miss runs what vLLM would have run (the plugin's fallback is vLLM's IR op, whose native
    impl runs here): compared with vLLM's own rms_norm kernel."""
    import vllm._custom_ops as vops
    from vllm import ir

    from prism_serve.patch.hooks import _next_provider

    monkeypatch.setitem(live.fallbacks, "rms_norm", _next_provider(ir.ops.rms_norm))

    def vllm_rms_norm(x, w):
        out = torch.empty_like(x)
        vops.rms_norm(out, x, w, EPS)
        return out

    before = dict(live.misses)
    x, w = torch.randn(8200, 128), torch.rand(128)  # beyond the largest bucket
    torch.testing.assert_close(torch.ops.prism.rms_norm(x, w, EPS), vllm_rms_norm(x, w))
    x, w = torch.randn(4, 96), torch.rand(96)  # a hidden size with no kernel
    torch.testing.assert_close(torch.ops.prism.rms_norm(x, w, EPS), vllm_rms_norm(x, w))
    x16, w16 = torch.randn(4, 128, dtype=torch.bfloat16), torch.rand(128, dtype=torch.bfloat16)  # another dtype
    torch.testing.assert_close(torch.ops.prism.rms_norm(x16, w16, EPS), vllm_rms_norm(x16, w16))
    assert live.misses["rms_norm"] - before["rms_norm"] == 3


def test_fake_impls_and_schemas(live):
    x, res, w = torch.randn(5, 128), torch.randn(5, 128), torch.rand(128)
    torch.library.opcheck(torch.ops.prism.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.prism.fused_add_rms_norm.default, (x, res, w, EPS))
    torch.library.opcheck(torch.ops.prism.silu_and_mul.default, (torch.randn(5, 512),))


def test_compiled_graph_keeps_the_ops_opaque_and_dispatches_per_call(live):
    def block(x, res, w, gu):
        y, r = torch.ops.prism.fused_add_rms_norm(x, res, w, EPS)
        return torch.ops.prism.rms_norm(y, w, EPS) + r, torch.ops.prism.silu_and_mul(gu)

    compiled = torch.compile(block, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (3, 20):  # one graph, two buckets
        x, res, w, gu = torch.randn(rows, 128), torch.randn(rows, 128), torch.rand(128), torch.randn(rows, 512)
        before = dict(live.counts)
        got, want = compiled(x, res, w, gu), block(x, res, w, gu)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        assert all(live.counts[k] - before[k] == 2 for k in OPS3)  # compiled call + eager call


def test_counters_file_is_written_only_by_a_process_that_ran_ops(tmp_path, monkeypatch, live):
    path = tmp_path / "counters.json"
    monkeypatch.setenv(runtime.COUNTERS_ENV, str(path))
    torch.ops.prism.rms_norm(torch.randn(2, 128), torch.rand(128), EPS)
    live.write_counters()
    data = json.loads(path.read_text())
    assert data["kernel"]["rms_norm"] >= 1 and set(data) >= {"kernel", "fallback", "failed_kernels", "pid"}


def test_seeded_kernels_are_proven(kernels_registry):
    reg = open_registry(kernels_registry)
    with reg.read() as s:
        loaded = load_device(s, current_device(use_vllm=False)[0], statuses=("verified",))
    reg.close()
    assert loaded.usable and not loaded.skipped
    assert all(k.sgraph.proof.get("ok") for k in loaded.usable)
    assert len(loaded.usable) == 8  # 4 programs (norm, residual norm, silu, q/k norm) x 2 buckets


def test_enabled_kernels_only_unless_forced(kernels_registry):
    assert not _table(kernels_registry, statuses=("enabled",)).ops


def test_add_kernel_roundtrip_keeps_buckets(tmp_path):
    device = current_device(use_vllm=False)[0]
    rs = seed.results([programs.rms_norm(64, "float32")], device, status="enabled")
    url = fill(tmp_path / "e.db", rs)
    reg = open_registry(url)
    with reg.write() as s:
        add_kernel(s, rs[0])  # the same key again: one row
    reg.close()
    b = _table(url, statuses=("enabled",)).entry("rms_norm", torch.float32, 64, EPS)
    assert (b.los, b.his) == ([1, 9], [8, 8192])


def test_swiglu_region_matches_vllms_projection_and_activation(regions_registry):
    table = _table(regions_registry)
    assert table.entry("swiglu", torch.float32, (128, 256)) is not None
    rt = ops.open_runtime(table)
    try:
        before = rt.counts["swiglu"]
        for rows in (1, 6, 21):
            x, w = torch.randn(rows, 128), 0.1 * torch.randn(512, 128)  # vLLM's merged [W_gate; W_up]
            torch.testing.assert_close(torch.ops.prism.swiglu(x, w, -1), ops.reference("swiglu")(x, w, -1))
        assert rt.counts["swiglu"] == before + 3
        torch.library.opcheck(torch.ops.prism.swiglu.default, (torch.randn(3, 128), torch.randn(512, 128), -1))
    finally:
        rt.close()


@pytest.fixture(scope="module")
def layer_regions(tmp_path_factory):
    """Kernels for a decoder layer's two sides: fused_add_rmsnorm_linear (128 -> 96) and rmsnorm_swiglu (128 -> 2 x 64)."""
    device = current_device(use_vllm=False)[0]
    progs = [programs.fused_add_rmsnorm_linear(128, 96, "float32"), programs.rmsnorm_swiglu(128, 64, "float32")]
    return _table(fill(tmp_path_factory.mktemp("layer") / "r.db", seed.results(progs, device)))


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_a_decoder_layers_regions_match_vllms_own_ops(layer_regions, rows):
    import vllm._custom_ops as vops
    from vllm.model_executor.layers.activation import SiluAndMul

    rt = ops.open_runtime(layer_regions)
    try:
        gen = torch.Generator().manual_seed(rows)
        x, res = torch.randn(rows, 128, generator=gen), torch.randn(rows, 128, generator=gen)
        g = 1 + 0.1 * torch.randn(128, generator=gen)
        w, w_gate_up = (torch.randn(n, 128, generator=gen) / 128 ** 0.5 for n in (96, 128))
        before = dict(rt.counts)
        y, r = torch.ops.prism.fused_add_rmsnorm_linear(x, res, g, w, EPS, -1)
        xv, rv = x.clone(), res.clone()
        vops.fused_add_rms_norm(xv, rv, g, EPS)  # vLLM's op: residual += x, x = rms_norm(residual) * g
        torch.testing.assert_close(r, rv)
        torch.testing.assert_close(y, torch.nn.functional.linear(xv, w))
        got = torch.ops.prism.rmsnorm_swiglu(r, g, w_gate_up, EPS, -1)
        normed = torch.empty_like(r)
        vops.rms_norm(normed, r, g, EPS)
        torch.testing.assert_close(got, SiluAndMul.forward_native(torch.nn.functional.linear(normed, w_gate_up)))
        assert {k: rt.counts[k] - before[k] for k in ("fused_add_rmsnorm_linear", "rmsnorm_swiglu")} == {
            "fused_add_rmsnorm_linear": 1, "rmsnorm_swiglu": 1}
        torch.library.opcheck(torch.ops.prism.fused_add_rmsnorm_linear.default, (x, res, g, w, EPS, -1))
        torch.library.opcheck(torch.ops.prism.rmsnorm_swiglu.default, (r, g, w_gate_up, EPS, -1))
    finally:
        rt.close()


def test_a_silu_miss_off_cuda_runs_vllms_own_silu_and_mul(live):
    from vllm.model_executor.layers.activation import SiluAndMul

    from prism_serve.patch import hooks

    done = hooks.Installed([], [])
    hooks._install_fallbacks(live, done)
    hooks._install_silu(live, done)
    try:
        assert done.names == ["SiluAndMul"] and done.kinds == {"silu_and_mul"}
        assert live.fallbacks["silu_and_mul"] is SiluAndMul.forward_native  # what vLLM runs on the CPU
        before = live.misses["silu_and_mul"]
        x = torch.randn(3, 2 * 96)  # an intermediate size with no kernel
        torch.testing.assert_close(torch.ops.prism.silu_and_mul(x), SiluAndMul.forward_native(x))
        assert live.misses["silu_and_mul"] == before + 1
    finally:
        done.revert()
    assert live.fallbacks["silu_and_mul"] is ops.ref_silu_and_mul


def test_geluandmul_tanh_runs_prism_in_eager_mode_and_exact_gelu_stays_vllms():
    """Gemma's GeGLU in eager mode: vLLM builds GeluAndMul(approximate="tanh") in its MLP (and Gemma
    caches it); with a table holding a gelu_tanh_and_mul kernel the plugin's class runs prism's op (a
    miss here: no launcher for the key, so vLLM's torch path), exact GELU keeps vLLM's path, and the
    switch undoes."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import GeluAndMul

    from prism_serve.patch import hooks
    from prism_serve.patch.table import Buckets, Table

    from vllm.model_executor.models.gemma import _get_gemma_act_fn

    tab = Table("cpu")
    tab.ops["gelu_tanh_and_mul"] = {(torch.float32, 96, None): Buckets()}
    rt = ops.open_runtime(tab)
    done = hooks.Installed([], [])
    try:
        with set_current_vllm_config(VllmConfig()):
            # Gemma caches the activation it builds: one built before the switch is not handed out after
            assert not getattr(_get_gemma_act_fn(None, "gelu_pytorch_tanh"), "_prism", False)
            hooks._install_gelu(rt, done)
            assert getattr(_get_gemma_act_fn(None, "gelu_pytorch_tanh"), "_prism", False)
            assert done.names == ["GeluAndMul"] and done.kinds == {"gelu_tanh_and_mul"}
            tanh, exact = GeluAndMul(approximate="tanh"), GeluAndMul()
            assert getattr(tanh, "_prism", False) and getattr(exact, "_prism", False)
            x = torch.randn(5, 2 * 96)
            before = rt.misses["gelu_tanh_and_mul"]
            want = torch.nn.functional.gelu(x[:, :96], approximate="tanh") * x[:, 96:]
            torch.testing.assert_close(tanh(x), want)
            assert rt.misses["gelu_tanh_and_mul"] == before + 1  # prism's op ran, and missed
            torch.testing.assert_close(exact(x), torch.nn.functional.gelu(x[:, :96]) * x[:, 96:])
            assert rt.misses["gelu_tanh_and_mul"] == before + 1  # exact GELU never reaches it
        done.revert()
        with set_current_vllm_config(VllmConfig()):
            assert not getattr(GeluAndMul(approximate="tanh"), "_prism", False)
            assert not getattr(_get_gemma_act_fn(None, "gelu_pytorch_tanh"), "_prism", False)
        assert rt.fallbacks["gelu_tanh_and_mul"] is ops.ref_gelu_tanh_and_mul
    finally:
        done.revert()
        rt.close()


def test_an_activation_vllm_built_before_the_switch_is_built_again(live):
    """vLLM keeps each named activation it built (`get_act_and_mul_fn`, its Transformers backend's
    path): one built before the plugin switched SiluAndMul, or before it switched back, must not be
    handed out after the switch."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import get_act_and_mul_fn

    from prism_serve.patch import hooks

    with set_current_vllm_config(VllmConfig()):  # vLLM builds its ops inside a config
        stock = get_act_and_mul_fn("silu")
        assert not getattr(stock, "_prism", False)
        done = hooks.Installed([], [])
        hooks._install_silu(live, done)
        try:
            prism = get_act_and_mul_fn("silu")
            assert getattr(prism, "_prism", False) and getattr(get_act_and_mul_fn("swish"), "_prism", False)
            before = live.counts["silu_and_mul"] + live.misses["silu_and_mul"]
            x = torch.randn(5, 2 * 128)
            torch.testing.assert_close(prism(x), stock.forward_native(x))
            assert live.counts["silu_and_mul"] + live.misses["silu_and_mul"] == before + 1
        finally:
            done.revert()
        assert not getattr(get_act_and_mul_fn("silu"), "_prism", False)


def test_a_class_hook_attaches_to_exactly_its_class_and_undoes_cleanly():
    """The eager-mode class hooks patch a vLLM class in place (every model that builds it is served,
    however it imported it) but attach only to instances of exactly that class: a subclass may
    rewire its layer after the base init ran (Aria swaps the MLP for experts), so it is left alone."""
    from prism_serve.patch.hooks import _patch_in_place

    class Layer:
        def __init__(self):
            self.mlp = "dense"

        def forward(self, x):
            return x + 1

    class Rewired(Layer):
        def __init__(self):
            super().__init__()
            self.mlp = "experts"

    attached = []
    undo = _patch_in_place(Layer, lambda layer: attached.append(layer.mlp),
                           lambda original: lambda self, x: original(self, x) * 10)
    Layer(), Rewired()
    assert attached == ["dense"] and Layer().forward(1) == 20 and Rewired().forward(1) == 20
    undo()
    assert Layer().forward(1) == 2 and "_prism_init" not in Layer.__dict__ and "forward" not in Rewired.__dict__
    attached.clear()
    Layer()
    assert attached == []


def test_a_miss_of_a_kind_the_table_does_not_serve_runs_vllms_own_path_too(layer_regions):
    """With only the decoder's residual-form regions stored, layer 0 (no residual) reaches
    rmsnorm_linear and a region the fusion pass formed reaches rms_norm and silu_and_mul: their
    misses run vLLM's path (its IR op, its activation, its modules), not the torch references."""
    from vllm import ir
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from prism_serve.patch import hooks

    assert not layer_regions.ops.get("rms_norm") and not layer_regions.ops.get("rmsnorm_linear")
    rt = ops.open_runtime(layer_regions)
    done = hooks.Installed([], [rt.close])
    hooks._install_fallbacks(rt, done)
    try:
        assert rt.fallbacks["silu_and_mul"] is SiluAndMul.forward_native  # vLLM's path on the CPU
        assert rt.fallbacks["rmsnorm_linear"].func is hooks._vllm_rmsnorm_linear
        assert rt.fallbacks["rms_norm"] is not ops.ref_rms_norm
        x, g = torch.randn(5, 128, dtype=torch.bfloat16), torch.rand(128, dtype=torch.bfloat16) + 0.5
        with set_current_vllm_config(VllmConfig()):
            norm = RMSNorm(128, eps=EPS, dtype=torch.bfloat16)
            norm.weight.data.copy_(g)
            want = norm.forward_native(x)
        torch.testing.assert_close(rt.fallbacks["rms_norm"](x, g, EPS), want, rtol=0, atol=0)
        torch.testing.assert_close(rt.fallbacks["rms_norm"](x, g, EPS), ir.ops.rms_norm(x, g, EPS), rtol=0, atol=0)
        saved = rt.fallbacks
    finally:
        done.revert()
    # back to the torch references: a region's miss then runs them in vLLM's order (`ops.vllm_path`)
    assert saved["rms_norm"] is ops.ref_rms_norm and "rmsnorm_linear" not in saved
