"""Registry rows for a model's vLLM ops built from the hand-built oracle sGraphs, proven and
instantiated for this device: what the tests and the benchmark load, and what `warmup` stores
the same way from the optimizer's results.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

from prism_serve.errors import SGraphError
from prism_serve.optimize.ir.ops import Op
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import default_assignment, oracle
from prism_serve.region_table import EXPERT_KINDS, KINDS, MOE_ACTIVATIONS, STYLE_DIM, Form, kind_of
from prism_serve.registry.gate import admit
from prism_serve.registry.store import DeviceInfo, KernelResult, Versions, current_versions

# (lo, hi) num_tokens buckets and the token block used in each: small blocks for decode
BUCKETS = (((1, 8), 4), ((9, 8192), 16))


# a Llama / Qwen3 decoder's op-level kinds (RMSNorm, residual add + RMSNorm, SiLU*mul) and the regions
# warmup stores for it (its input side without and with the residual, its post-attention side)
_NORM = kind_of(Form("rms"))
OP_KINDS = tuple(kind_of(f).name for f in (Form("rms"), Form("rms", residual=True), Form(act=Op.SILU)))
REGION_KINDS = tuple(kind_of(f).name for f in (Form("rms", projection=True), Form("rms", residual=True, projection=True),
                                               Form("rms", projection=True, act=Op.SILU)))
# its rotary embedding, and QK-norm + rotary where the model norms q and k per head (Qwen3)
ROTARY, QK_NORM_ROTARY = (kind_of(f).name for f in (Form(rotary=True), Form("rms", rotary=True)))
ROTARY_KINDS = (ROTARY, QK_NORM_ROTARY)
# the routed experts of a mixture-of-experts model (Mixtral, Qwen3-MoE), by its activation
MOE_KINDS = tuple(k.name for k in EXPERT_KINDS)
# model types whose q and k are normed per head before rotary, and those that rotate GPT-J's interleaved pairs
_QK_NORMED, _GPTJ = ("qwen3",), ("glm4",)


def model_programs(config_path, dtype: str = "float32", kinds=OP_KINDS) -> list:
    """The Programs of `kinds` (region table names) for a Hugging Face Llama / Qwen3 / GLM-4 config: a norm
    kind also at the q/k norm's head_dim (Qwen3), a norm + projection kind at the qkv projection, rotary
    at its heads, head_dim and rotary_dim (GLM-4's: half the head, GPT-J style), QK-norm + rotary only
    where the model norms q and k (Qwen3)."""
    cfg = json.loads(Path(config_path).read_text())
    hidden, inter, eps = cfg["hidden_size"], cfg["intermediate_size"], float(cfg.get("rms_norm_eps", 1e-6))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    dims = {"hidden": hidden, "intermediate": inter, "out": (heads + 2 * kv_heads) * head_dim}
    progs = [KINDS[k].program(dims, dtype, eps) for k in kinds if k not in ROTARY_KINDS + MOE_KINDS]
    if _NORM.name in kinds and qk_normed(cfg):
        progs.append(_NORM.program({"hidden": head_dim}, dtype, eps))
    progs += [KINDS[k].program(rotary_dims(cfg), dtype, eps) for k in kinds
              if k == ROTARY or (k == QK_NORM_ROTARY and qk_normed(cfg))]
    moe = moe_dims(cfg)
    progs += [KINDS[k].program(moe, dtype) for k in kinds if k in MOE_KINDS and moe is not None
              and KINDS[k].form.act == _MOE_ACTS.get(cfg.get("hidden_act", MOE_ACTIVATIONS[Op.SILU]))]
    return progs


# a config's hidden_act -> the experts' activation (Hugging Face names SiLU as vLLM does)
_MOE_ACTS = MappingProxyType({MOE_ACTIVATIONS[Op.SILU]: Op.SILU, "gelu_pytorch_tanh": Op.GELU_TANH})


def moe_dims(cfg: dict) -> dict[str, int] | None:
    """A mixture-of-experts config's experts dims (Mixtral's num_local_experts and intermediate_size,
    Qwen3-MoE's num_experts and moe_intermediate_size), or None for a dense model."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts or not cfg.get("num_experts_per_tok"):
        return None
    return {"num_experts": experts, "top_k": cfg["num_experts_per_tok"], "hidden": cfg["hidden_size"],
            "intermediate": cfg.get("moe_intermediate_size") or cfg["intermediate_size"]}


def qk_normed(cfg: dict) -> bool:
    """Whether the model norms q and k per head before rotary (Qwen3)."""
    return cfg.get("model_type") in _QK_NORMED


def rotary_dims(cfg: dict) -> dict[str, int] | None:
    """A Hugging Face config's rotary dims as vLLM builds its RotaryEmbedding: rotary_dim = head_dim *
    partial_rotary_factor (GLM-4's default 0.5, GPT-J style), the cache's max_position_embeddings rows
    (None where the config does not say)."""
    if "max_position_embeddings" not in cfg:
        return None
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    gptj = cfg.get("model_type") in _GPTJ
    rope = cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5 if gptj else 1.0))
    return {"heads": heads, "kv_heads": cfg.get("num_key_value_heads") or heads, "head_dim": head_dim,
            "rotary_dim": int(head_dim * factor), "max_position": cfg["max_position_embeddings"],
            STYLE_DIM: int(not gptj)}


def results(progs, device: DeviceInfo, *, status: str = "verified", versions: Versions | None = None,
            buckets=BUCKETS, gpu: str = "h100", model: str = "") -> list[KernelResult]:
    """One instantiated oracle kernel per program and bucket, each through the registry's gate
    (proven and numerically checked here; raises RegistryError naming one that is not)."""
    spec = get_gpu(gpu if device.kind == "cpu" else device.name)
    out = []
    for prog in progs:
        g = oracle(prog)
        for bucket, block_tokens in buckets:
            params = _fitting(g, block_tokens, spec)
            out.append(KernelResult(
                program=prog, sgraph=g, device=device, dtype=prog.inputs[0].attr("dtype"), bucket=bucket,
                params=params, versions=versions or current_versions(), status=status,
                reason="forced test kernel" if status == "verified" else "measured faster",
                sources=((model, prog.name),) if model else ()))
    return admit(out)  # proven and checked here, like every result the registry takes


def _fitting(g, block_tokens: int, spec) -> dict[str, int]:
    """The default assignment with the largest token block <= `block_tokens`, then the largest target
    tile (64 down to 8: the experts' windows hold a whole intermediate dim), that fits `spec`."""
    error = None
    bt = block_tokens
    while bt >= 1:
        for tile in (64, 32, 16, 8):
            params = default_assignment(g, block_tokens=bt, target_tile=tile)
            try:
                instantiate(g, params, spec)
                return params
            except SGraphError as exc:
                error = exc
        bt //= 2
    raise error
