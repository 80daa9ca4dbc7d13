"""The doctor: which layers of a model would be patched on this device, and why others not."""

from __future__ import annotations

from prism_serve.patch.doctor import patch_report, print_patch_report

from ..checkpoints import DTYPE


REGIONS = ("swiglu", "rmsnorm_linear", "fused_add_rmsnorm_linear", "rmsnorm_swiglu")
ROTARY = ("rotary", "qk_norm_rotary")


def test_every_layer_of_qwen3_is_patched_with_forced_kernels(kernels_registry):
    r = patch_report("tiny-qwen3", kernels_registry, force=True, dtype=DTYPE)
    assert r["plugin"] == "would patch" and r["device"].startswith("cpu:")
    ops = [row for row in r["layers"] if row["op"] not in REGIONS + ROTARY]
    assert len(ops) == 2 * 5 + 1  # per layer: input norm, q norm, k norm, post norm, act; the final norm
    assert all(row["patched"] for row in ops)
    assert ops[0]["op"] == "rms_norm" and ops[0]["buckets"][0].startswith("1-8: kernel")
    assert {row["op"] for row in ops if "q_norm" in row["layer"]} == {"rms_norm"}
    by = {(row["layer"], row["op"]): row for row in r["layers"]}
    mlp = by["model.layers.0.mlp", "rmsnorm_swiglu"]
    assert not mlp["patched"] and "no kernel in the registry for rmsnorm_swiglu (128, 256, float32" in mlp["why"]
    attn = by["model.layers.1.self_attn", "fused_add_rmsnorm_linear"]
    assert not attn["patched"] and "no kernel in the registry for fused_add_rmsnorm_linear (128, 256" in attn["why"]
    assert r["served"] == {"fused_add_rms_norm": ["model.layers.0.post_attention_layernorm",
                                                  "model.layers.1.input_layernorm",
                                                  "model.layers.1.post_attention_layernorm", "model.norm"],
                           "rms_norm": ["model.layers.0.input_layernorm", "model.layers.0.self_attn.q_norm",
                                        "model.layers.0.self_attn.k_norm", "model.layers.1.self_attn.q_norm",
                                        "model.layers.1.self_attn.k_norm"],
                           "silu_and_mul": ["model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"]}
    assert r["unserved"] == []
    # rotary: every layer's rotary_emb, and Qwen3's QK-norm + rotary, listed with why not (no kernel stored)
    rot = {row["layer"]: row for row in r["layers"] if row["op"] in ROTARY}
    assert set(rot) == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.rotary_emb", "self_attn.q_norm+model.layers.{i}.self_attn.k_norm+model.layers.{i}.self_attn.rotary_emb"
        .replace("{i}", str(i)))}
    assert all(not row["patched"] and "no kernel in the registry for" in row["why"] for row in rot.values())


def test_decoder_regions_take_in_the_ops_they_span(regions_registry):
    r = patch_report("tiny-llama", regions_registry, force=True, dtype=DTYPE)
    by = {(row["layer"], row["op"]): row for row in r["layers"]}
    for i in (0, 1):
        p = f"model.layers.{i}."
        side = "rmsnorm_linear" if i == 0 else "fused_add_rmsnorm_linear"
        assert by[p + "self_attn", side]["patched"] and by[p + "self_attn", side]["buckets"]
        assert "inside its layer's " + side in by[p + "input_layernorm", "rms_norm" if i == 0 else "fused_add_rms_norm"]["why"]
        assert by[p + "mlp", "rmsnorm_swiglu"]["patched"] and by[p + "mlp", "rmsnorm_swiglu"]["buckets"]
        for layer, op in (("post_attention_layernorm", "fused_add_rms_norm"), ("mlp.gate_up_proj", "swiglu"),
                          ("mlp.act_fn", "silu_and_mul")):
            row = by[p + layer, op]
            assert row["patched"] and "inside its layer's rmsnorm_swiglu" in row["why"] and "buckets" not in row
            assert row["inside"] == p + "mlp"
    # every kind stored for the model's sizes is named with the layers it serves; swiglu, stored beside
    # rmsnorm_swiglu, serves none (rmsnorm_swiglu takes the MLPs in), and the doctor says so
    assert r["served"]["rmsnorm_swiglu"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert r["served"]["fused_add_rmsnorm_linear"] == ["model.layers.1.self_attn"]
    assert r["served"]["rmsnorm_linear"] == ["model.layers.0.self_attn"]
    assert r["served"]["fused_add_rms_norm"] == ["model.norm"]
    assert r["unserved"] == ["rms_norm", "silu_and_mul", "swiglu"]


def test_reasons_when_nothing_would_be_patched(kernels_registry, tmp_path):
    unforced = patch_report("tiny-llama", kernels_registry, force=False, dtype=DTYPE)
    assert unforced["plugin"] == "nothing"
    assert "PRISM_SERVE_FORCE=1 would use the verified ones" in unforced["layers"][0]["why"]
    other_dtype = patch_report("tiny-llama", kernels_registry, dtype="float16", force=True)
    norm = next(row for row in other_dtype["layers"] if row["layer"] == "model.layers.0.input_layernorm")
    assert "no kernel in the registry for rms_norm (128, float16, eps 1e-06)" in norm["why"]
    missing = patch_report("tiny-llama", str(tmp_path / "none.db"), dtype=DTYPE)
    assert "no registry at" in missing["layers"][0]["why"] and not (tmp_path / "none.db").exists()


def test_report_prints_as_a_table(kernels_registry):
    from rich.console import Console

    console = Console(record=True, width=200)
    print_patch_report(patch_report("tiny-llama", kernels_registry, force=True, dtype=DTYPE), console)
    text = console.export_text()
    assert "model.layers.1.mlp.act_fn" in text and "1-8: kernel" in text and "would patch" in text


def test_dtype_comes_from_the_weights_when_config_json_has_none(kernels_registry, tmp_path):
    """The model's own dtype is config.json's, else its weights'; the one kernels are looked up for
    is what vLLM's dtype="auto" runs it in: float32 is downcast to bfloat16 (or asked for)."""
    from tests.checkpoints import write_checkpoint

    write_checkpoint("tiny-llama", tmp_path / "fp32", drop_dtype=True)
    r = patch_report(tmp_path / "fp32", kernels_registry, force=True)
    assert r["model_dtype"] == "float32"  # the weights are float32; float16 was the old guess
    assert r["dtype"] == "bfloat16"  # what `vllm serve` runs it in, so the float32 kernels serve nothing
    assert not any(row["patched"] for row in r["layers"])
    r = patch_report(tmp_path / "fp32", kernels_registry, force=True, dtype="float32")
    norm = next(row for row in r["layers"] if row["layer"] == "model.layers.0.input_layernorm")
    assert norm["patched"]  # served with --dtype float32
    half = {k: v.half() for k, v in write_checkpoint("tiny-llama", tmp_path / "fp16", drop_dtype=True).items()}
    from safetensors.torch import save_file
    save_file(half, str(tmp_path / "fp16" / "model.safetensors"))
    assert patch_report(tmp_path / "fp16", kernels_registry, force=True)["dtype"] == "float16"


def test_json_names_each_rows_pattern_its_kernels_or_why_not(regions_registry, monkeypatch):
    """`prism-serve doctor tiny-llama --json`: tiny-llama has a site of every region kind but Gemma's
    (RMSNorm with 1 + w and the GeGLU regions, which only the compiled-mode pass serves, hook
    "pattern", and tanh-GELU*mul), the biased projections and the MoE experts (it is dense); each row names the vLLM op chain it
    matches, a served row the registry's kernels for it."""
    import json

    from typer.testing import CliRunner

    from prism_serve.cli import app
    from prism_serve.region_table import KINDS
    from prism_serve.registry import open_registry
    from prism_serve.registry.store import list_kernels

    monkeypatch.setenv("PRISM_SERVE_REGISTRY", regions_registry)
    monkeypatch.setenv("PRISM_SERVE_FORCE", "1")
    res = CliRunner().invoke(app, ["doctor", "tiny-llama", "--json", "--dtype", DTYPE])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["patch"]["layers"]
    assert {r["op"] for r in rows} == {k for k, kind in KINDS.items()
                                       if kind.hook != "pattern" and not kind.form.experts} - {"gelu_tanh_and_mul"}
    assert all(r["pattern"] == " -> ".join(KINDS[r["op"]].vllm_path) for r in rows)
    reg = open_registry(regions_registry, readonly=True)
    with reg.read() as s:
        program_of = {k.id: k.program.name for k in list_kernels(s)}
    reg.close()
    own = [r for r in rows if r.get("buckets")]
    assert {r["op"] for r in own} == {"rmsnorm_linear", "fused_add_rmsnorm_linear", "rmsnorm_swiglu",
                                      "fused_add_rms_norm"}
    for r in own:  # "lo-hi: kernel N", N a kernel of that very kind
        assert all(program_of[int(b.rsplit("kernel ", 1)[1])] == r["kernel"] for b in r["buckets"]), r
    assert all(r["why"] for r in rows if not r["patched"])


def test_quantized_weights_lora_and_an_unsupported_dtype_are_named(regions_registry, tmp_path):
    import json

    from prism_serve.capture.embedded import embedded_path
    from prism_serve.region_table import KINDS

    projections = {k for k, kind in KINDS.items() if "linear" in kind.vllm_path}
    cfg = json.loads((embedded_path("tiny-llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    for report, why in ((patch_report(tmp_path, regions_registry, force=True, dtype=DTYPE), "quantized weight (fp8)"),
                        (patch_report("tiny-llama", regions_registry, force=True, lora=True, dtype=DTYPE), "LoRA: adapters")):
        for r in report["layers"]:
            if r["op"] in projections:
                assert not r["patched"] and r["why"].startswith(why), r
        # the norms then serve as ops: the final norm, and the norms no region takes in any more
        assert report["served"]["fused_add_rms_norm"] == ["model.layers.0.post_attention_layernorm",
                                                          "model.layers.1.input_layernorm",
                                                          "model.layers.1.post_attention_layernorm", "model.norm"]
    fp8 = patch_report("tiny-llama", regions_registry, dtype="float8_e4m3fn", force=True)
    assert fp8["layers"] and all(not r["patched"] and r["why"].startswith("unsupported dtype float8_e4m3fn")
                                 for r in fp8["layers"])


def test_a_float32_gemma_norm_runs_on_a_plain_norm_kernel_where_the_table_has_one(kernels_registry):
    """In float32 GemmaRMSNorm hands vLLM's RMSNorm op the computed weight w + 1, of x's dtype, so
    prism's IR provider takes it wherever the table holds a plain norm kernel for the key (as
    Dynamo traces, before any Gemma pattern), in both modes: the doctor names that kernel."""
    region = {"kind": "gemma_fused_add_rms_norm", "dims": {"hidden": 128}, "eps": 1e-6, "supported": True,
              "reason": None, "modules": ["norm"], "dtype": "float32"}
    r = patch_report("tiny-llama", kernels_registry, force=True, capture={"regions": [region], "dtype": "float32"})
    [row] = r["layers"]
    assert row["patched"] and row["kernel"] == "fused_add_rms_norm" and "IR provider" in row["why"]
    assert row["eager"] and row["eager_kernel"] == "fused_add_rms_norm"
    # in half precision the computed weight is float32, not x's dtype: the IR provider refuses it, a
    # plain norm kernel at the key serves nothing there, Gemma's own kernel does
    import torch

    from prism_serve.patch.doctor import Site, _kernel
    from prism_serve.patch.table import Buckets, Table

    table = Table("cpu")
    for op in ("fused_add_rms_norm", "gemma_fused_add_rms_norm"):
        table.ops[op] = {(torch.float16, 128, 1e-6): Buckets()}
    site = Site("norm", "gemma_fused_add_rms_norm", 128, 1e-6)
    assert _kernel(site, torch.float16, table)[0] == "gemma_fused_add_rms_norm"
    table.ops["fused_add_rms_norm"][torch.float32, 128, 1e-6] = Buckets()
    assert _kernel(site, torch.float32, table)[0] == "fused_add_rms_norm"  # though no float32 Gemma kernel


def test_qwen2s_layers_are_its_biased_input_side_and_its_mlp_region():
    """Qwen2's qkv projection has a bias: its input side is the `_bias` kinds (the fusion pass serves
    them), and its MLP side the plain rmsnorm_swiglu, as a capture of it reports."""
    from prism_serve.patch.doctor import sites

    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-6}
    ops = {(s.layer, s.op) for s in sites(cfg)}
    assert {("model.layers.0.self_attn", "rmsnorm_linear_bias"), ("model.layers.1.self_attn", "fused_add_rmsnorm_linear_bias"),
            ("model.layers.0.mlp", "rmsnorm_swiglu"), ("model.layers.1.mlp", "rmsnorm_swiglu")} <= ops
    assert not {op for _, op in ops} & {"rmsnorm_linear", "fused_add_rmsnorm_linear"}
