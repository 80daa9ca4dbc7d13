"""The experts ops in this process (no vLLM engine): `prism::moe_experts` runs the registry's
two-kernel design for (dtype, experts, top-k, hidden, intermediate) on vLLM's [T, H] tokens and
[T, k] routing, matching vLLM's semantics (the torch reference) at 1 token and an odd count, with
an expert no token chose; another top-k is a miss that runs vLLM's path; the fake keeps x's shape."""

from __future__ import annotations

import pytest
import torch

from prism_serve.optimize.workloads import programs
from prism_serve.patch import ops, seed
from prism_serve.patch.device import current_device
from prism_serve.patch.table import build_table
from prism_serve.registry import open_registry
from prism_serve.registry.store import load_device

from .conftest import fill

E, K, H, I = 4, 2, 64, 48


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    progs = [programs.moe_experts(E, K, H, I, "float32"), programs.moe_experts_gelu_tanh(E, K, H, I, "float32")]
    url = fill(tmp_path_factory.mktemp("moe") / "moe.db", seed.results(progs, current_device(use_vllm=False)[0]))
    reg = open_registry(url)
    with reg.read() as s:
        table = build_table(load_device(s, current_device(use_vllm=False)[0], statuses=("verified",)).usable, "cpu")
    reg.close()
    return table


@pytest.fixture
def live(table):
    return ops.open_runtime(table)  # closed after the test (conftest)


def _routing(tokens: int, top_k: int = K, seed_: int = 0):
    gen = torch.Generator().manual_seed(seed_)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    return torch.softmax(torch.randn(tokens, top_k, generator=gen), -1), ids  # expert E - 1: chosen by none


@pytest.mark.parametrize("kind", ["moe_experts", "moe_experts_gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_the_experts_kernel_computes_vllms_experts(live, kind, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 8, torch.randn(E, H, I, generator=gen) / 8
    weights, ids = _routing(tokens)
    before = live.counts[kind]
    got = getattr(torch.ops.prism, kind)(x, weights, ids, w13, w2)
    assert live.counts[kind] == before + 1 and got.shape == x.shape
    want = ops.ref_moe_experts(ops.KINDS[kind].form.act)(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_another_top_k_is_a_miss_that_runs_vllms_path(live):
    x, w13, w2 = torch.randn(3, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    weights, ids = _routing(3, top_k=1)
    misses = live.misses["moe_experts"]
    got = torch.ops.prism.moe_experts(x, weights, ids, w13, w2)
    assert live.misses["moe_experts"] == misses + 1
    assert torch.allclose(got, ops.ref_moe_experts(ops.KINDS["moe_experts"].form.act)(x, weights, ids, w13, w2))


def test_the_fake_keeps_the_tokens_shape():
    ops.define()
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(5, H)
        out = torch.ops.prism.moe_experts(x, torch.empty(5, K), torch.empty(5, K, dtype=torch.int32),
                                          torch.empty(E, 2 * I, H), torch.empty(E, H, I))
        assert out.shape == (5, H)


def test_a_miss_on_packed_weights_runs_vllms_cpu_fused_moe(live):
    """Where vLLM's CPU experts packed the weights, a miss runs its own kernel on them (`experts_hook`)."""
    vops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        pytest.skip("this vLLM build has no CPU fused MoE")
    from prism_serve.patch import experts_hook
    from prism_serve.patch.runtime import PackedExperts

    gen = torch.Generator().manual_seed(3)
    inter = 64  # vLLM's CPU kernel takes intermediate sizes in multiples of 32 (it pads the layer's)
    x, w13, w2 = (torch.randn(3, H, generator=gen), torch.randn(E, 2 * inter, H, generator=gen) / 8,
                  torch.randn(E, H, inter, generator=gen) / 8)
    weights, ids = _routing(3)
    p13, p2 = vops.cpu_prepack_moe_weight(w13, "vec"), vops.cpu_prepack_moe_weight(w2, "vec")
    live.experts[p13.data_ptr()] = PackedExperts(w13, w2, "vec")
    got = experts_hook.vllm_cpu_experts(live, ops.KINDS["moe_experts"])(x, weights, ids, p13, p2)
    want = ops.ref_moe_experts(ops.KINDS["moe_experts"].form.act)(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), (got - want).abs().max()
