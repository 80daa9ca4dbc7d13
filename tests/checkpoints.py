"""Random-weight safetensors checkpoints of tiny models (Hugging Face layouts), so greedy tokens
depend on every layer (vLLM's dummy weights make near-constant logits).

The embedded tiny models (tiny-llama, tiny-qwen3) keep their shipped config; the other
architectures take tiny-llama's sizes (2 layers, hidden 128, head_dim 32, vocab 256) with the
fields their Hugging Face config needs (`ARCH_CONFIGS`). Weight names and shapes follow each
architecture's Hugging Face layout (`_layer_tensors`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prism_serve.capture.embedded import EMBEDDED, embedded_path
from prism_serve.optimize.pipeline.search import WORK_PER_S

# the dtype the tests' vLLM runs models in (tests/patch/vllm_child.py), so captures and warmups are
# asked for it: vLLM's default ("auto") would run these float32 checkpoints in bfloat16
DTYPE = "float32"
# the search of the tests' warmups: they test capture, checks, storage and serving, not search
# quality (scripts/bench_search.py measures that). On the embedded model the four norm and MLP
# regions verify at 4 s as at warmup's default 60 s (2026-12-06, a 2-core AMD EPYC), and their
# searches run until their work or their budget ends, so the work is that of a 10 s search: tiny
# Qwen3-MoE's qk_norm_rotary region finds none at 400,000 steps, and its designs at 500,000
# (2026-12-08; the routed experts' two-kernel design fits from 300,000 at tiny Qwen2-MoE's dims). The
# rotary region's whole search is 198,064 steps (every subtree ends), but takes 15-20 s under the
# suite's load (not found at 8 s or 12 s, 2026-12-07): the budget, a wall-clock limit, is 20 s.
WARMUP_WORK = 10 * WORK_PER_S
WARMUP_BUDGET_S = 20.0
_BASE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 256,
         "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "vocab_size": 256, "tie_word_embeddings": False,
         "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}

# decoder architectures beyond the embedded ones: what each adds to tiny-llama's sizes
ARCH_CONFIGS: dict[str, dict] = {
    "tiny-mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "tiny-qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
    "tiny-gemma": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu_pytorch_tanh",
                   "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    # Gemma in half precision, where its norm's float32 weight w + 1 is not the activations' dtype
    # (float16: on AMX machines vLLM's CPU build runs small bfloat16 weights through its own GEMM,
    # which prism does not match, and float16 ones through oneDNN, as every large weight)
    "tiny-gemma-fp16": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma",
                        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                        "tie_word_embeddings": True, "torch_dtype": "float16"},
    "tiny-gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 4096,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "layer_types": ["full_attention", "full_attention"]},
    "tiny-phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rms_norm_eps": 1e-05,
                  "sliding_window": None, "pad_token_id": 0},
    "tiny-granite": {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "embedding_multiplier": 4.0,
                     "residual_multiplier": 0.5, "attention_multiplier": 0.125, "logits_scaling": 2.0,
                     "attention_bias": False, "mlp_bias": False},
    "tiny-olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
                   "pad_token_id": 0},
    # GLM-4: rotary on half of each head (partial_rotary_factor 0.5), GPT-J's interleaved pairs, and a norm
    # after attention and after the MLP besides the usual two
    "tiny-glm4": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "partial_rotary_factor": 0.5,
                  "attention_bias": False, "pad_token_id": 0},
    "tiny-mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "sliding_window": None,
                     "num_local_experts": 4, "num_experts_per_tok": 2},
    # Qwen3-MoE: QK-norm, every layer sparse, a router renormalising its top-k, experts narrower than hidden
    "tiny-qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 10000.0},
    # Qwen2-MoE without its shared expert: Qwen2's qkv bias and a mixture of experts in one model (CI's
    # one architecture), every layer sparse, a router that does not renormalise its top-k
    "tiny-qwen2-moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 0,
                       "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                       "use_sliding_window": False},
}
# an encoder for the pooling runner (not a prism target): BERT layout, its own tokenizer
BERT_CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 128, "intermediate_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu", "max_position_embeddings": 256,
               "type_vocab_size": 2, "layer_norm_eps": 1e-12, "vocab_size": 256, "pad_token_id": 0,
               "torch_dtype": "float32"}


def dtype_of(model: str) -> str:
    """The dtype the tests run `model` in: its config's, where that is a half precision one (which
    vLLM then keeps), else `DTYPE`."""
    dtype = config_of(model).get("torch_dtype")
    return dtype if dtype in ("float16", "bfloat16") else DTYPE


def config_of(model: str) -> dict:
    if model in EMBEDDED:
        return json.loads((embedded_path(model) / "config.json").read_text())
    if model == "tiny-bert":
        return dict(BERT_CONFIG)
    if model not in ARCH_CONFIGS:
        raise ValueError(f"no tiny checkpoint recipe for {model!r}")
    return {**_BASE, **ARCH_CONFIGS[model]}


def write_checkpoint(model: str, path: Path, seed: int = 0, embed_scale: float = 0.2,
                     drop_dtype: bool = False) -> dict[str, torch.Tensor]:
    """Write `model`'s config and random weights to `path`; return the weights written.
    `drop_dtype`: leave the dtype out of config.json (the weights are float32 all the same)."""
    cfg = config_of(model)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)).contiguous()

    if cfg["model_type"] == "bert":
        tensors = _bert_tensors(cfg, rand)
    else:
        tensors = _decoder_tensors(cfg, rand, embed_scale)
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    if drop_dtype:
        cfg = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype")}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    if cfg["model_type"] == "bert":
        _write_tokenizer(path, cfg["vocab_size"])
    return tensors


def _decoder_tensors(cfg: dict, rand, embed_scale: float) -> dict[str, torch.Tensor]:
    h, vocab, kind = cfg["hidden_size"], cfg["vocab_size"], cfg["model_type"]
    # Gemma's norms scale by (1 + weight): stored near 0, so the scale is near 1 like the others'
    one = 0.0 if kind in ("gemma", "gemma2") else 1.0

    def norm(n):
        return one + rand(n, scale=0.1)

    tensors = {"model.embed_tokens.weight": rand(vocab, h, scale=embed_scale), "model.norm.weight": norm(h)}
    if not cfg.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        tensors |= {f"model.layers.{i}.{k}": v for k, v in _layer_tensors(cfg, rand, norm).items()}
    return tensors


def _layer_tensors(cfg: dict, rand, norm) -> dict[str, torch.Tensor]:
    """One decoder layer's weights, by the architecture's Hugging Face names."""
    h, inter, hd, kind = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["model_type"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    if kind == "phi3":  # merged projections
        t = {"self_attn.qkv_proj.weight": rand(q + 2 * kv, h), "self_attn.o_proj.weight": rand(h, q),
             "mlp.gate_up_proj.weight": rand(2 * inter, h)}
    else:
        t = {"self_attn.q_proj.weight": rand(q, h), "self_attn.k_proj.weight": rand(kv, h),
             "self_attn.v_proj.weight": rand(kv, h), "self_attn.o_proj.weight": rand(h, q)}
    if kind in ("qwen3_moe", "qwen2_moe"):  # a router and experts (gate, up, down) in place of one MLP
        moe = cfg["moe_intermediate_size"]
        t["mlp.gate.weight"] = rand(cfg["num_experts"], h)
        if kind == "qwen2_moe":  # the shared expert's gate, built (and loaded) with no shared expert to gate
            t["mlp.shared_expert_gate.weight"] = rand(1, h)
        for e in range(cfg["num_experts"]):
            t |= {f"mlp.experts.{e}.gate_proj.weight": rand(moe, h), f"mlp.experts.{e}.up_proj.weight": rand(moe, h),
                  f"mlp.experts.{e}.down_proj.weight": rand(h, moe)}
    elif kind == "mixtral":  # a router and experts (w1 gate, w3 up, w2 down) in place of one MLP
        t["block_sparse_moe.gate.weight"] = rand(cfg["num_local_experts"], h)
        for e in range(cfg["num_local_experts"]):
            t |= {f"block_sparse_moe.experts.{e}.w1.weight": rand(inter, h),
                  f"block_sparse_moe.experts.{e}.w3.weight": rand(inter, h),
                  f"block_sparse_moe.experts.{e}.w2.weight": rand(h, inter)}
    else:
        if kind != "phi3":
            t |= {"mlp.gate_proj.weight": rand(inter, h), "mlp.up_proj.weight": rand(inter, h)}
        t["mlp.down_proj.weight"] = rand(h, inter)
    if kind != "olmo2":  # OLMo 2 normalises after attention and MLP, not before
        t["input_layernorm.weight"] = norm(h)
    t["post_attention_layernorm.weight"] = norm(h)
    if kind in ("qwen2", "qwen2_moe"):  # qkv bias
        t |= {"self_attn.q_proj.bias": rand(q, scale=0.5), "self_attn.k_proj.bias": rand(kv, scale=0.5),
              "self_attn.v_proj.bias": rand(kv, scale=0.5)}
    if kind in ("qwen3", "qwen3_moe"):
        t |= {"self_attn.q_norm.weight": norm(hd), "self_attn.k_norm.weight": norm(hd)}
    if kind == "olmo2":  # q/k norm over all heads at once
        t |= {"self_attn.q_norm.weight": norm(q), "self_attn.k_norm.weight": norm(kv),
              "post_feedforward_layernorm.weight": norm(h)}
    if kind == "glm4":
        t |= {"post_self_attn_layernorm.weight": norm(h), "post_mlp_layernorm.weight": norm(h)}
    if kind == "gemma2":
        t |= {"pre_feedforward_layernorm.weight": norm(h), "post_feedforward_layernorm.weight": norm(h)}
    return t


def _bert_tensors(cfg: dict, rand) -> dict[str, torch.Tensor]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def ln(p):
        return {p + ".weight": 1 + rand(h, scale=0.1), p + ".bias": rand(h, scale=0.1)}

    def lin(p, o, i):
        return {p + ".weight": rand(o, i), p + ".bias": rand(o, scale=0.1)}

    t = {"embeddings.word_embeddings.weight": rand(vocab, h, scale=0.2),
         "embeddings.position_embeddings.weight": rand(cfg["max_position_embeddings"], h, scale=0.2),
         "embeddings.token_type_embeddings.weight": rand(cfg["type_vocab_size"], h, scale=0.2),
         **ln("embeddings.LayerNorm"), **lin("pooler.dense", h, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        t |= {**lin(p + "attention.self.query", h, h), **lin(p + "attention.self.key", h, h),
              **lin(p + "attention.self.value", h, h), **lin(p + "attention.output.dense", h, h),
              **ln(p + "attention.output.LayerNorm"), **lin(p + "intermediate.dense", inter, h),
              **lin(p + "output.dense", h, inter), **ln(p + "output.LayerNorm")}
    return t


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordPiece tokenizer over `vocab_size` made-up tokens (BERT's special tokens first), built
    with `tokenizers` here: the pooling runner needs a tokenizer, and nothing is downloaded."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = specials + letters + [a + b for a in letters for b in letters]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "model_max_length": 256,
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "mask_token": "[MASK]"}))
