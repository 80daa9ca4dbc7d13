"""`prism-serve capture`: the table and JSON report, and one clear line for each bad input."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from prism_serve.capture import runner as capture_runner
from prism_serve.capture.cli import capture_command
from prism_serve.capture.embedded import embedded_path

app = typer.Typer()
app.command("capture")(capture_command)


@app.callback()
def _root() -> None:
    """Stand-in for the root app, which wires capture in the same way."""


def _invoke(*args):
    return CliRunner().invoke(app, ["capture", *map(str, args)])


def test_report_table_and_json(llama_capture, monkeypatch, tmp_path):
    monkeypatch.setattr(capture_runner, "capture", lambda model, dtype: llama_capture)
    out = tmp_path / "report.json"
    res = _invoke("tiny-llama", "--json", out)
    assert res.exit_code == 0, res.output
    assert "rmsnorm_linear" in res.output and "unsupported" in res.output
    doc = json.loads(out.read_text())
    assert doc["model"] == llama_capture.model
    kinds = {r["kind"] for r in doc["regions"]}
    assert {"rmsnorm_linear", "swiglu", "fused_add_rms_norm"} <= kinds
    r = next(r for r in doc["regions"] if r["kind"] == "swiglu")
    assert set(r) >= {"program_hash", "program", "dims", "layers", "time_share", "buckets"}
    from prism_serve.optimize.ir.schema import program_from_json

    assert program_from_json(r["program"]).canonical_hash == r["program_hash"]
    attn = next(r for r in doc["regions"] if r["kind"] == "attention")
    assert not attn["supported"] and attn["reason"] and attn["program_hash"] is None
    cfg = json.loads((embedded_path("tiny-llama") / "config.json").read_text())
    assert attn["dims"] == {"heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
                            "head_dim": cfg["head_dim"]}
    assert attn["shapes"] == doc["attention_shapes"] and attn["buckets"] == doc["buckets"]
    assert "attention forwards" in res.output and attn["reason"] in res.output


def _bad_configs(tmp_path):
    cfg = json.loads((embedded_path("tiny-llama") / "config.json").read_text())
    unknown, rejected, empty, garbled = (tmp_path / n for n in ("unknown", "rejected", "empty", "garbled"))
    for d in (unknown, rejected, empty, garbled):
        d.mkdir()
    (garbled / "config.json").write_text("{not json")
    (unknown / "config.json").write_text(json.dumps(cfg | {"architectures": ["NoSuchModelForCausalLM"]}))
    (rejected / "config.json").write_text(json.dumps(cfg | {"num_key_value_heads": 3}))
    return {"missing": (tmp_path / "nope", "does not exist"), "no_config": (empty, "no config.json"),
            "bad_json": (garbled, "not valid JSON"),
            "unknown_arch": (unknown, "NoSuchModelForCausalLM"), "rejected": (rejected, "vLLM rejected")}


@pytest.mark.parametrize("case", ["missing", "no_config", "bad_json", "unknown_arch", "rejected"])
def test_bad_input_one_line_nonzero_nothing_written(case, tmp_path):
    model, needle = _bad_configs(tmp_path)[case]
    out = tmp_path / "report.json"
    res = _invoke(model, "--json", out)
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.output
    assert not out.exists()


def test_a_pooling_model_is_reported_region_by_region_with_nothing_stored_or_patched(tmp_path, monkeypatch):
    """A BERT embedder runs with vLLM's pooling runner (which needs its tokenizer): warmup captures
    it, reports each of its regions unsupported with the reason, and stores nothing, so the
    plugin has nothing to patch."""
    from prism_serve.cli import app as root
    from prism_serve.patch.device import current_device
    from prism_serve.patch.plugin import plan
    from prism_serve.registry import open_registry
    from prism_serve.registry.store import list_kernels

    from ..checkpoints import write_checkpoint

    model, out, url = tmp_path / "bert", tmp_path / "report.json", f"sqlite:///{tmp_path / 'registry.db'}"
    write_checkpoint("tiny-bert", model)
    monkeypatch.setenv("PRISM_SERVE_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(root, ["warmup", str(model), "--registry", url, "--json", str(out)])
    assert res.exit_code == 0, res.output
    regions = json.loads(out.read_text())["regions"]
    assert regions and all(r["status"] == "skipped" and "'pooling' runner" in r["reason"] for r in regions)
    # the encoder's own modules, as vLLM's BERT builds them, each reported
    assert {"LayerNorm", "QKVParallelLinear", "GELU", "EncoderOnlyAttention"} <= {r["kind"] for r in regions}
    reg = open_registry(url, readonly=True)
    with reg.read() as s:
        assert list_kernels(s) == []
    reg.close()
    device, device_type = current_device(use_vllm=False)
    assert plan(url, device, device_type, force=True).state == "nothing"


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_an_unwritable_report_path_fails_in_one_line_before_the_capture(where, tmp_path, monkeypatch):
    def no_capture(*_a):
        raise AssertionError("captured before checking where the report goes")

    monkeypatch.setattr(capture_runner, "capture", no_capture)
    out = tmp_path / "nope" / "report.json" if where == "missing folder" else tmp_path
    res = _invoke("tiny-llama", "--json", out)
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: cannot write the capture report at ") and str(out) in line, res.output
