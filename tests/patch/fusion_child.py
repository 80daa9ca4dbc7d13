"""Run vLLM offline in compiled mode in this fresh process with, as the only prism hook, the
fusion pass (the entry-point plugin is off through PRISM_SERVE_DISABLE=1; this script installs
the registry's table and the pass the way the plugin does), or stock vLLM with `stock`. Writes
greedy tokens, the prism op counters, the pass's record and whether vLLM's config carried it.

    python tests/patch/fusion_child.py MODEL_DIR OUT.json {pass|stock}
"""

import json
import os
import sys

from vllm_child import ENV, MAX_TOKENS, MODES, PROMPTS


def main(model: str, out: str, how: str) -> int:
    os.environ.update(ENV)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from prism_serve.patch import fusion, ops
    from prism_serve.patch.hooks import Installed
    from prism_serve.patch.plugin import plan

    installed = Installed([], [])
    if how == "pass":
        p = plan(force=True)
        assert p.state == "ready", p.message
        ops.define_ops()
        ops.STATE.table = p.table
        fusion.install(p.table, installed)
    llm = LLM(model=model, load_format="auto", skip_tokenizer_init=True, max_model_len=256,
              max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", seed=0, **MODES["compiled"])
    cc = llm.llm_engine.vllm_config.compilation_config
    carried = type(cc.inductor_compile_config.get("post_grad_custom_post_pass")).__name__
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": ops.counters(),
              "installed": installed.names, "config_pass": carried, "mode": int(cc.mode), "backend": cc.backend,
              "graphs": fusion.RUNS["graphs"], "replaced": dict(fusion.REPLACED)}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
