"""One vLLM capture run per model, shared by every test that needs it (each run is ~20 s)."""

from __future__ import annotations

import json

import pytest
import torch

from prism_serve.capture import capture
from prism_serve.capture.embedded import embedded_path


@pytest.fixture(scope="session")
def llama_capture():
    return capture("tiny-llama")


@pytest.fixture(scope="session")
def qwen3_capture():
    return capture("tiny-qwen3")


def llama_checkpoint(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random-weight safetensors checkpoint with the Hugging Face Llama layout, in `path`."""
    from safetensors.torch import save_file

    cfg = json.loads((embedded_path("tiny-llama") / "config.json").read_text())
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)).contiguous()

    tensors = {"model.embed_tokens.weight": rand(vocab, h, scale=1.0), "model.norm.weight": 1 + rand(h, scale=0.1),
               "lm_head.weight": rand(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
                    p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
                    p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                    p + "input_layernorm.weight": 1 + rand(h, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("real-llama")
    return path, llama_checkpoint(path)


@pytest.fixture(scope="session")
def real_capture(real_checkpoint):
    return capture(real_checkpoint[0])
