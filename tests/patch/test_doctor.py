"""The doctor: which layers of a model would be patched on this device, and why others not."""

from __future__ import annotations

from prism_serve.patch.doctor import patch_report, print_patch_report


def test_every_layer_of_qwen3_is_patched_with_forced_kernels(kernels_registry):
    r = patch_report("tiny-qwen3", kernels_registry, force=True)
    assert r["plugin"] == "would patch" and r["device"].startswith("cpu:")
    ops = [row for row in r["layers"] if row["op"] not in ("swiglu", "rmsnorm_linear")]
    assert len(ops) == 2 * 5 + 1  # per layer: input norm, q norm, k norm, post norm, act; the final norm
    assert all(row["patched"] for row in ops)
    assert ops[0]["op"] == "rms_norm" and ops[0]["buckets"][0].startswith("1-8: kernel")
    assert {row["op"] for row in ops if "q_norm" in row["layer"]} == {"rms_norm"}
    mlp = next(row for row in r["layers"] if row["layer"] == "model.layers.0.mlp")
    assert not mlp["patched"] and "no kernel in the registry for swiglu (128, 256, float32)" in mlp["why"]
    attn = next(row for row in r["layers"] if row["layer"] == "model.layers.0.self_attn")
    assert not attn["patched"] and "no kernel in the registry for rmsnorm_linear (128, 256" in attn["why"]


def test_swiglu_region_takes_the_activation_with_it(regions_registry):
    r = patch_report("tiny-llama", regions_registry, force=True)
    by = {row["layer"]: row for row in r["layers"]}
    assert by["model.layers.1.mlp"]["patched"] and by["model.layers.1.mlp"]["buckets"]
    assert by["model.layers.1.mlp.act_fn"]["patched"] and "inside its layer's region" in by["model.layers.1.mlp.act_fn"]["why"]
    # the input norm + qkv projection region takes the input norms in
    assert by["model.layers.1.self_attn"]["patched"] and by["model.layers.1.self_attn"]["buckets"]
    for norm in ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm"):
        assert by[norm]["patched"] and "inside its layer's region" in by[norm]["why"]
    assert "buckets" in by["model.layers.1.post_attention_layernorm"]  # still its own kernel


def test_reasons_when_nothing_would_be_patched(kernels_registry, tmp_path):
    unforced = patch_report("tiny-llama", kernels_registry, force=False)
    assert unforced["plugin"] == "nothing"
    assert "PRISM_SERVE_FORCE=1 would use the verified ones" in unforced["layers"][0]["why"]
    other_dtype = patch_report("tiny-llama", kernels_registry, dtype="float16", force=True)
    assert "no kernel in the registry for rms_norm (128, float16, eps 1e-06)" in other_dtype["layers"][0]["why"]
    missing = patch_report("tiny-llama", str(tmp_path / "none.db"))
    assert "no registry at" in missing["layers"][0]["why"] and not (tmp_path / "none.db").exists()


def test_report_prints_as_a_table(kernels_registry):
    from rich.console import Console

    console = Console(record=True, width=200)
    print_patch_report(patch_report("tiny-llama", kernels_registry, force=True), console)
    text = console.export_text()
    assert "model.layers.1.mlp.act_fn" in text and "1-8: kernel" in text and "would patch" in text
