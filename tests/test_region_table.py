"""The region table: every kind's Program, key and served sites, and which sites a larger region takes in."""

from __future__ import annotations

import pytest

from prism_serve.optimize.workloads import programs
from prism_serve.region_table import HOOKS, KINDS, OP_KINDS, VLLM_OPS, Site, eager_served, served_sites, servable

# rotary's: odd head counts, a partial rotary_dim, GPT-J style (neox 0)
DIMS = {"hidden": 96, "intermediate": 40, "out": 72, "heads": 3, "kv_heads": 1, "head_dim": 16, "rotary_dim": 8,
        "max_position": 40, "neox": 0, "num_experts": 5, "top_k": 2}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_builds_its_program_and_keys_it(name):
    kind = KINDS[name]
    prog = kind.program(DIMS, "float16", 1e-5)
    assert prog.name == name and set(kind.vllm_path) <= set(VLLM_OPS) and kind.hook in HOOKS
    key = kind.key_of(prog)
    assert key[0] == "float16" and key[2] == (1e-5 if kind.has_eps else None)
    assert key[1] == kind.key_dim(kind.dims_of(prog))
    if kind.has_eps:  # another epsilon is another program
        assert kind.key_of(kind.program(DIMS, "float16", 1e-6)) != key


def test_the_moe_experts_kinds_key_their_experts_routing_and_sizes():
    """An experts kind is keyed by (experts, top-k, hidden, intermediate), takes vLLM's experts' apply
    arguments, and is vLLM's fused MoE today; its activation is its kind, not a key dim."""
    keys = {}
    for name in ("moe_experts", "moe_experts_gelu_tanh"):
        kind = KINDS[name]
        keys[name] = kind.key_of(kind.program(DIMS, "bfloat16"))
        assert kind.args == ("x", "topk_weights", "topk_ids", "w13", "w2") and kind.outputs == ("y",)
        assert kind.vllm_path == ("fused_moe",) and kind.hook == "experts" and kind not in OP_KINDS
        assert eager_served(Site(name, frozenset({"layers.0.block_sparse_moe.experts"})), {})
    assert keys["moe_experts"] == keys["moe_experts_gelu_tanh"] == ("bfloat16", (5, 2, 96, 40), None)
    assert KINDS["moe_experts"].key_of(KINDS["moe_experts_gelu_tanh"].program(DIMS, "bfloat16")) is None


@pytest.mark.parametrize("name", ["rotary", "qk_norm_rotary"])
def test_a_rotary_kinds_style_is_a_key_dim_read_back_from_its_program(name):
    kind = KINDS[name]
    keys = {}
    for neox in (0, 1):
        prog = kind.program(DIMS | {"neox": neox}, "float32", 1e-6)
        assert kind.dims_of(prog)["neox"] == neox
        keys[neox] = kind.key_of(prog)
    assert keys[0][1][-1] == 0 and keys[1][1][-1] == 1 and keys[0][1][:-1] == keys[1][1][:-1] == (3, 1, 16, 8, 40)
    assert kind.args[:3] == ("positions", "q", "k") and kind.outputs == ("q_out", "k_out")
    assert kind.vllm_path[-1] == "rotary_embedding"
    assert kind.vllm_path == (("rms_norm", "rms_norm", "rotary_embedding") if kind.form.norm else ("rotary_embedding",))


def test_a_program_of_another_shape_family_is_not_the_kind():
    assert KINDS["rmsnorm_linear"].key_of(programs.rmsnorm_mlp(96, 40, "float16")) is None
    assert KINDS["rms_norm"].key_of(programs.fused_add_rms_norm(96, "float16")) is None


def _layer(i: int) -> list[Site]:
    p = f"model.layers.{i}."
    norm, post = p + "input_layernorm", p + "post_attention_layernorm"
    qkv, gate_up, act = p + "self_attn.qkv_proj", p + "mlp.gate_up_proj", p + "mlp.act_fn"
    return [Site("fused_add_rms_norm", frozenset({norm})), Site("fused_add_rmsnorm_linear", frozenset({norm, qkv})),
            Site("fused_add_rms_norm", frozenset({post})), Site("fused_add_rmsnorm_linear", frozenset({post, gate_up})),
            Site("swiglu", frozenset({gate_up, act})), Site("rmsnorm_swiglu", frozenset({post, gate_up, act})),
            Site("silu_and_mul", frozenset({act}))]


def test_larger_served_regions_take_in_what_they_span():
    sites = _layer(1) + [Site("fused_add_rms_norm", frozenset({"model.norm"}))]
    served = served_sites(sites)
    own = {s.kind for s, cover in served.items() if cover is None}
    assert own == {"fused_add_rmsnorm_linear", "rmsnorm_swiglu", "fused_add_rms_norm"}
    assert served[sites[0]] == sites[1]  # the input norm runs inside the input side's kernel
    assert all(served[s] == sites[5] for s in (sites[2], sites[4], sites[6]))
    assert sites[3] not in served  # no hook serves a norm feeding gate_up alone
    assert served[sites[-1]] is None  # the final norm is its own kernel


def test_a_failed_region_leaves_its_parts_served():
    sites = _layer(0)
    served = served_sites(sites, failed={sites[5]})  # rmsnorm_swiglu found no kernel
    assert served[sites[4]] is None and served[sites[6]] == sites[4] and served[sites[2]] is None


def test_servable_only_at_the_modules_its_hook_patches():
    assert servable("rms_norm", ["anything.q_norm"])  # an IR provider: wherever vLLM runs the op
    assert servable("rmsnorm_swiglu", ["m.layers.0.post_attention_layernorm", "m.layers.0.mlp.gate_up_proj",
                                       "m.layers.0.mlp.act_fn"])
    assert not servable("rmsnorm_linear", ["m.layers.0.post_attention_layernorm", "m.layers.0.mlp.gate_up_proj"])
    assert not servable("attention", ["m.layers.0.self_attn.attn"])
    # vLLM's Transformers backend (OLMo 2): Dynamo names the MLP's modules through its bound forward
    assert servable("swiglu", ["layers.0.mlp.forward.__self__.gate_up_proj", "layers.0.mlp.forward.__self__.act_fn"])
    mlp = "layers.0.mlp.forward.__self__."
    swiglu, silu = Site("swiglu", frozenset({mlp + "act_fn", mlp + "gate_up_proj"})), Site("silu_and_mul",
                                                                                        frozenset({mlp + "act_fn"}))
    assert served_sites([swiglu, silu]) == {swiglu: None, silu: swiglu}  # in roles' order, whatever the set's


def _classes(layer: str, mlp: str) -> dict[str, str]:
    return {"model.layers.1": layer, "model.layers.1.mlp": mlp}


def test_eager_mode_serves_regions_only_in_the_classes_its_hooks_patch():
    post, gate_up, act = (f"model.layers.1.{m}" for m in ("post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn"))
    rmsnorm_swiglu, swiglu = Site("rmsnorm_swiglu", frozenset({post, gate_up, act})), Site("swiglu",
                                                                                          frozenset({gate_up, act}))
    llama, qwen2 = _classes("LlamaDecoderLayer", "LlamaMLP"), _classes("Qwen2DecoderLayer", "Qwen2MLP")
    assert eager_served(rmsnorm_swiglu, llama) and not eager_served(rmsnorm_swiglu, qwen2)
    assert eager_served(swiglu, qwen2) and not eager_served(swiglu, _classes("Glm4DecoderLayer", "Glm4MLP"))
    assert eager_served(Site("rms_norm", frozenset({"anything.q_norm"})), {})  # an op wherever vLLM runs it
    assert not eager_served(Site("rmsnorm_geglu", frozenset({post, gate_up, act})), llama)  # compiled mode only
    # Transformers backend paths are read in their roles
    mlp = "layers.0.mlp.forward.__self__."
    assert eager_served(Site("swiglu", frozenset({mlp + "gate_up_proj", mlp + "act_fn"})), {"layers.0.mlp": "LlamaMLP"})


def test_with_classes_a_site_only_compiled_mode_takes_in_keeps_its_own_kernel():
    """Qwen2: no eager hook patches its decoder layer, so in eager mode its MLP is served by the
    MLP hook (swiglu) and its norms as ops, though compiled mode runs them inside the larger regions."""
    sites = _layer(1)
    own = lambda served: {(s.kind, min(s.modules)) for s, cover in served.items() if cover is None}  # noqa: E731
    compiled = own(served_sites(sites))
    assert own(served_sites(sites, classes=_classes("LlamaDecoderLayer", "LlamaMLP"))) == compiled
    qwen2 = served_sites(sites, classes=_classes("Qwen2DecoderLayer", "Qwen2MLP"))
    assert own(qwen2) == compiled | {("swiglu", "model.layers.1.mlp.act_fn"),
                                     ("fused_add_rms_norm", "model.layers.1.input_layernorm"),
                                     ("fused_add_rms_norm", "model.layers.1.post_attention_layernorm")}
    assert qwen2[sites[6]] == sites[5]  # SiLU*mul: inside swiglu in eager mode, inside rmsnorm_swiglu compiled


def test_the_eager_classes_are_the_ones_the_hooks_patch():
    pytest.importorskip("vllm")
    from prism_serve.patch import hooks

    mlps = {cls.__name__ for _, _, cls in hooks._model_classes(hooks.REGIONS)}
    layers = {cls.__name__ for _, _, cls in hooks._model_classes(hooks.DECODER_LAYERS)}
    assert KINDS["swiglu"].eager_classes == mlps
    assert all(KINDS[k].eager_classes == layers for k in hooks.LAYER_FALLBACKS)
    assert not [k for k, kind in KINDS.items() if kind.hook in ("mlp", "decoder_layer") and not kind.eager_classes]


def test_a_kinds_name_is_written_in_the_region_table_alone():
    """Every other module derives what it needs from a kind's structure (`RegionKind.form`, `args`):
    outside optimize/ no module but the region table writes a kind's name, except vLLM's own op
    names where vLLM's op is matched or called (the patterns' and capture's vLLM forms)."""
    import ast
    from pathlib import Path

    import prism_serve

    root = Path(prism_serve.__file__).parent
    written: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "optimize":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and n.value in KINDS:
                written.setdefault(n.value, set()).add(str(path.relative_to(root)))
    vllms = {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul"}
    assert {k: m for k, m in written.items() if k not in vllms and m != {"region_table.py"}} == {}
    assert all("region_table.py" in m for m in written.values())
