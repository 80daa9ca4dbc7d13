"""Run one model offline in compiled mode in this fresh process, first as stock vLLM, then with the
registry's kernels installed the way the plugin installs them (the entry-point plugin is off
through PRISM_SERVE_DISABLE=1, so the first run is stock). Writes both runs' greedy tokens, the
prism op counters of the second, the fusion pass's record, whether vLLM's config carried the pass
and whether any eager-mode class hook attached to a layer.

    python tests/patch/fusion_child.py MODEL_DIR OUT.json
"""

import gc
import json
import os
import sys

from vllm_child import ENV, MAX_TOKENS, MODES, PROMPTS


def generate(model: str) -> tuple[list, object, int]:
    """Greedy tokens, the compilation config, and how many plain weights the plugin held for
    vLLM's oneDNN handles while the model was alive."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, load_format="auto", skip_tokenizer_init=True, max_model_len=256,
              max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", seed=0, **MODES["compiled"])
    cc = llm.llm_engine.vllm_config.compilation_config
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    from prism_serve.patch import ops
    packed = sorted(list(w.shape) for w in ops.PACKED.values())
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], cc, packed


def main(model: str, out: str) -> int:
    os.environ.update(ENV)
    from prism_serve.patch import fusion, hooks, ops
    from prism_serve.patch.plugin import plan

    stock, _, _ = generate(model)
    p = plan(force=True)
    assert p.state == "ready", p.message
    installed = hooks.install(p.table)
    before = ops.counters()
    tokens, cc, packed = generate(model)
    after = ops.counters()
    result = {"stock": stock, "tokens": tokens, "installed": installed.names,
              "kernel": {k: after["kernel"][k] - before["kernel"][k] for k in after["kernel"]},
              "fallback": {k: after["fallback"][k] - before["fallback"][k] for k in after["fallback"]},
              "config_pass": type(cc.inductor_compile_config.get("post_grad_custom_post_pass")).__name__,
              "mode": int(cc.mode), "backend": cc.backend, "graphs": fusion.RUNS["graphs"],
              "replaced": dict(fusion.REPLACED), "class_hooked": len(hooks.LAYER_SITES) + len(hooks.SITES),
              "packed": packed}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
