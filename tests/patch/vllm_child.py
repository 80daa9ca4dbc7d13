"""Run vLLM offline in this fresh process (vLLM rebinds torch's threads for its whole process):
greedy tokens for fixed prompts in each mode asked for, the plugin's status and the prism op
counters per mode, as JSON.

    python tests/patch/vllm_child.py MODEL_DIR OUT.json eager [compiled]
"""

import gc
import json
import os
import sys
import time

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_USE_AOT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = ([1, 5, 9, 13, 17, 21, 25], [3, 4], list(range(2, 40)))  # 7, 2 and 38 tokens: both buckets
MAX_TOKENS = 6
MODES = {"eager": {"enforce_eager": True},
         "compiled": {"enforce_eager": False, "compilation_config": {"mode": 3, "cudagraph_mode": "NONE"}}}


def run(model: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from prism_serve.patch import ops

    before = ops.counters()
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(model))
    t0 = time.time()
    llm = LLM(model=model, load_format="auto" if has_weights else "dummy", skip_tokenizer_init=True,
              max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", seed=0,
              **MODES[mode])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    after = ops.counters()
    del llm
    gc.collect()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(time.time() - t0, 2),
            "kernel": {k: after["kernel"][k] - before["kernel"][k] for k in after["kernel"]},
            "fallback": {k: after["fallback"][k] - before["fallback"][k] for k in after["fallback"]}}


def inject_faults(spec: str) -> None:
    """Test only: in this process, make one kernel's load and another's every call raise
    SystemExit(3), as a payload calling exit() would, to show the plugin survives code that does
    (the typed loader leaves no stored data that could). `spec`: {"load": id, "call": id}."""
    from prism_serve.patch import table

    faults, prepare, build = json.loads(spec), table._prepare, table.build_table

    def exits(*args):
        exit(3)

    def _prepare(k, gpu):
        return exits() if k.id == faults["load"] else prepare(k, gpu)

    def build_table(*args, **kw):
        t = build(*args, **kw)
        for per in t.ops.values():
            for buckets in per.values():
                for launcher in buckets.launchers:
                    if launcher.kernel_id == faults["call"]:
                        launcher.run = exits
        return t

    table._prepare, table.build_table = _prepare, build_table


def main(model: str, out: str, modes: list[str]) -> int:
    os.environ.update(ENV)
    if os.environ.get("PRISM_TEST_FAULTS"):
        inject_faults(os.environ["PRISM_TEST_FAULTS"])
    result: dict = {"runs": {mode: run(model, mode) for mode in modes}}
    from prism_serve.patch import STATUS, ops
    result["plugin"] = {"state": STATUS.state, "message": STATUS.message, "patched": STATUS.patched,
                        "kernels": STATUS.kernels, "skipped": STATUS.skipped}
    result["counters"] = ops.counters()
    from prism_serve import patch  # vLLM may call the plugin again: nothing changes, nothing is logged
    patch.register()
    result["again"] = {"state": STATUS.state, "message": STATUS.message}
    from vllm import ir
    from vllm.model_executor.custom_op import op_registry_oot
    patch.unpatch()
    result["after_unpatch"] = {"ir_providers": sorted(ir.ops.rms_norm.impls), "oot": sorted(op_registry_oot),
                               "state": STATUS.state}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:] or ["eager"]))
