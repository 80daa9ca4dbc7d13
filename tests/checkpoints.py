"""Random-weight safetensors checkpoints of the embedded tiny models (Hugging Face layouts), so
greedy tokens depend on every layer (vLLM's dummy weights make near-constant logits)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prism_serve.capture.embedded import embedded_path


def write_checkpoint(model: str, path: Path, seed: int = 0, embed_scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Write `model`'s config and random weights to `path`; return the weights written."""
    cfg = json.loads((embedded_path(model) / "config.json").read_text())
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)).contiguous()

    def norm(n):
        return 1 + rand(n, scale=0.1)

    tensors = {"model.embed_tokens.weight": rand(vocab, h, scale=embed_scale), "model.norm.weight": norm(h)}
    if not cfg.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
                    p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
                    p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                    p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)}
        if cfg["model_type"] == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors
