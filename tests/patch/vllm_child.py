"""Run vLLM offline in this fresh process (vLLM rebinds torch's threads for its whole process),
once per *config* of a list, one after the other: greedy tokens for fixed prompts in each mode
the config asks for, the plugin's status and the prism op counters per mode, as JSON.

    python tests/patch/vllm_child.py MODEL_DIR OUT.json CONFIGS.json

CONFIGS.json is a list of {"name", "env": {PRISM_SERVE_* settings}, "modes": ["eager", ...],
"dtype": optional (vLLM's, default float32), "faults": optional (see `inject_faults`)}. The plugin acts once per process, so before each
config this script undoes what it patched (`patch.unpatch`), applies the config's settings and
calls the entry point `patch.register()` itself (vLLM calls it only at its first start in a
process), as a fresh process would. Each config's inductor and vLLM compile caches are its own
directory: a cached graph would come back without the plugin's pass having run. A line
`prism-test: config NAME` on stdout precedes each config's log, so the test splits the log.
"""

import gc
import json
import os
import sys
import time

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_USE_AOT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = ([1, 5, 9, 13, 17, 21, 25], [3, 4], list(range(2, 40)))  # 7, 2 and 38 tokens: both buckets
MAX_TOKENS = 4  # the prefill and three decode steps of each prompt
MODES = {"eager": {"enforce_eager": True},
         "compiled": {"enforce_eager": False, "compilation_config": {"mode": 3, "cudagraph_mode": "NONE"}}}
MARK = "prism-test: config "


def run(model: str, mode: str, dtype: str = "float32") -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from prism_serve.patch.runtime import Runtime, current

    rt = current() or Runtime()  # the runtime the plugin installed for this config (none: nothing ran)
    before, graphs, replaced = rt.counters(), rt.runs["graphs"], rt.replaced.copy()
    sites = len(rt.layer_sites) + len(rt.sites)
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(model))
    t0 = time.time()
    llm = LLM(model=model, load_format="auto" if has_weights else "dummy", skip_tokenizer_init=True,
              max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, dtype=dtype, seed=0,
              **MODES[mode])
    cc = llm.llm_engine.vllm_config.compilation_config
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    after = rt.counters()
    # plain weights held while the model lives, recorded when vLLM packed them (oneDNN, AMX)
    packed = sorted(list(w.shape) for w in (*rt.packed.values(), *rt.packed_amx.values()) if w is not None)
    del llm
    gc.collect()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(time.time() - t0, 2),
            "kernel": {k: after["kernel"][k] - before["kernel"][k] for k in after["kernel"]},
            "fallback": {k: after["fallback"][k] - before["fallback"][k] for k in after["fallback"]},
            # what vLLM compiled with and what the fusion pass did in this run
            "compile": {"mode": int(cc.mode), "backend": cc.backend,
                        "config_pass": type(cc.inductor_compile_config.get("post_grad_custom_post_pass")).__name__,
                        "graphs": rt.runs["graphs"] - graphs, "replaced": dict(rt.replaced - replaced),
                        "class_hooked": len(rt.layer_sites) + len(rt.sites) - sites, "packed": packed}}


def inject_faults(spec: dict):
    """Test only: in this process, make one kernel's load and another's every call raise
    SystemExit(3), as a payload calling exit() would, to show the plugin survives code that does
    (the typed loader leaves no stored data that could). `spec`: {"load": id, "call": id}.
    Returns the function that takes the faults out again."""
    from prism_serve.patch import table

    prepare, build = table._prepare, table.build_table

    def exits(*args):
        exit(3)

    def _prepare(k, gpu):
        return exits() if k.id == spec["load"] else prepare(k, gpu)

    def build_table(*args, **kw):
        t = build(*args, **kw)
        for per in t.ops.values():
            for buckets in per.values():
                for launcher in buckets.launchers:
                    if launcher.kernel_id == spec["call"]:
                        launcher.run = exits
        return t

    table._prepare, table.build_table = _prepare, build_table

    def undo():
        table._prepare, table.build_table = prepare, build
    return undo


def run_config(model: str, config: dict, scratch: str, modelinfos: str) -> dict:
    """One config, as a fresh process with its settings would run it (`modelinfos`: vLLM's
    model-info cache of this machine)."""
    from prism_serve import patch
    from prism_serve.patch import STATUS
    from prism_serve.patch.runtime import Runtime, current

    patch.unpatch()
    for key in [k for k in os.environ if k.startswith("PRISM_SERVE_")]:
        del os.environ[key]
    caches = os.path.join(scratch, config["name"].replace(" ", "-"))
    os.environ.update(config.get("env", {}), TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                      VLLM_CACHE_ROOT=os.path.join(caches, "vllm"))
    # vLLM's model-info cache (what each model class supports, found in a subprocess when cold: 7 s
    # of each engine's 11 here) is the one a fresh vLLM process on this machine reads; only the
    # compile caches are the config's own
    os.makedirs(os.path.join(caches, "vllm"), exist_ok=True)
    os.symlink(modelinfos, os.path.join(caches, "vllm", "modelinfos"))
    print(MARK + config["name"], flush=True)
    undo = inject_faults(config["faults"]) if config.get("faults") else None
    try:
        patch.register()
        result: dict = {"runs": {mode: run(model, mode, config.get("dtype", "float32")) for mode in config["modes"]}}
    finally:
        if undo is not None:
            undo()
    result["plugin"] = {"state": STATUS.state, "message": STATUS.message, "patched": STATUS.patched,
                        "kernels": STATUS.kernels, "skipped": STATUS.skipped, "seconds": STATUS.seconds}
    result["counters"] = (current() or Runtime()).counters()
    patch.register()  # vLLM may call the plugin again: nothing changes, nothing is logged
    result["again"] = {"state": STATUS.state, "message": STATUS.message}
    from vllm import ir
    from vllm.model_executor.custom_op import op_registry_oot
    patch.unpatch()
    result["after_unpatch"] = {"ir_providers": sorted(ir.ops.rms_norm.impls), "oot": sorted(op_registry_oot),
                               "state": STATUS.state}
    return result


def main(model: str, out: str, configs: str) -> int:
    from vllm import envs

    modelinfos = os.path.join(envs.VLLM_CACHE_ROOT, "modelinfos")  # vLLM's own, before configs set theirs
    os.makedirs(modelinfos, exist_ok=True)
    os.environ.update(ENV)
    scratch = os.path.join(os.path.dirname(os.path.abspath(out)), f"caches-{os.getpid()}")
    with open(configs) as f:
        results = {c["name"]: run_config(model, c, scratch, modelinfos) for c in json.load(f)}
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
