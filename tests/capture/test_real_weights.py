"""A model with real weights in safetensors is captured the same way, and the weights read
back through vLLM are the ones written."""

from __future__ import annotations

import torch

from prism_serve.optimize.ir.reference import evaluate, max_rel_error


def test_real_weights_are_loaded_and_programs_match(real_capture, real_checkpoint):
    _, written = real_checkpoint
    assert real_capture.load_format == "auto"
    by_site = {(i.kind, i.modules[-1]): i for i in real_capture.instances if i.supported}
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        kind = "rmsnorm_linear" if layer == 0 else "fused_add_rmsnorm_linear"  # (x, [residual,] g, w)
        qkv = by_site[(kind, f"layers.{layer}.self_attn.qkv_proj")]
        want = torch.cat([written[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        torch.testing.assert_close(qkv.inputs[-1], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(qkv.inputs[-2], written[p + "input_layernorm.weight"], rtol=0, atol=0)
        sw = by_site[("swiglu", f"layers.{layer}.mlp.act_fn")]
        torch.testing.assert_close(sw.inputs[1], written[p + "mlp.gate_proj.weight"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sw.inputs[2], written[p + "mlp.up_proj.weight"], rtol=1e-6, atol=1e-6)
        ns = by_site[("rmsnorm_swiglu", f"layers.{layer}.mlp.act_fn")]
        torch.testing.assert_close(ns.inputs[1], written[p + "post_attention_layernorm.weight"], rtol=0, atol=0)
        torch.testing.assert_close(ns.inputs[2:], sw.inputs[1:], rtol=0, atol=0)
    for inst in by_site.values():
        got = evaluate(inst.program, inst.inputs)
        for g, want in zip(got, inst.outputs):
            assert max_rel_error(g, want) < 1e-5, inst.modules


def test_same_programs_as_dummy_weights(real_capture, llama_capture):
    hashes = lambda res: {r.program.canonical_hash for r in res.regions if r.supported}  # noqa: E731
    assert hashes(real_capture) == hashes(llama_capture)
