"""The capture child process: `python -m prism_serve.capture.child MODEL_DIR OUT_DIR [DTYPE]`.

Starts vLLM on the model with the capture backend, in DTYPE (vLLM's `dtype`; default "auto", vLLM's
own choice, which runs a float32 checkpoint in bfloat16: the dtype `vllm serve` runs it in), records one prefill forward
(the region inputs/outputs for fidelity checks), then times a short batched
generation with mixed prompt lengths under torch.profiler (a pooling model, which vLLM
runs with its tokenizer, embeds the prompts instead and is reported as no prism target). Writes
``OUT_DIR/result.json`` (always; ``{"ok": false, "error": ...}`` on failure) and,
on success, ``OUT_DIR/record.pt`` with recorded tensors and the regions' weights.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported inside the functions, after vLLM's environment is set
    import torch
from pathlib import Path

# its prefill and one decode forward are recorded, and warmup checks every bucket range's kernel on
# both: 40 tokens span a full 32-row token tile (what the larger buckets' kernels tile by) and a
# partial one, and each smaller tile several times (7 tokens left all but one row tile unchecked)
RECORD_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19,
                 71, 69, 39, 93, 75, 10, 58, 20, 97, 49, 44, 59, 23, 7, 81, 64, 6, 28, 62, 8]
HOT_PROMPT_LENS = (3, 9, 17, 33, 60)  # mixed lengths, batched
HOT_MAX_TOKENS = 6
MAX_MODEL_LEN = 256  # capture needs only short prompts
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt")
# PRISM_SERVE_DISABLE: capture traces vLLM's own ops, which are also what warmup checks kernels
# against, even when the registry already holds kernels the plugin would patch in.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_USE_AOT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false", "PRISM_SERVE_DISABLE": "1"}


def _one_line(exc: BaseException) -> str:
    """The informative line of an exception: pydantic's 'Value error, ...' line; for an error that
    torch.fx's interpreter re-raised under torch.compile, its own first line and the node it ran
    (the rest is the graph's traceback and a pointer to tlparse); else the last line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("For further information", "Use tlparse"))] or [""]
    executing = next((ln for ln in lines if ln.startswith("While executing")), None)
    if executing is not None and lines[0] != executing:
        line = f"{lines[0]} ({executing[0].lower()}{executing[1:]})"
    else:
        line = next((ln for ln in lines if ln.startswith("Value error,")), lines[-1])
    line = re.sub(r"\s*\[type=.*$", "", line.removeprefix("Value error,").strip())
    if len(line) > 300:
        line = line[:297] + "..."
    return f"{type(exc).__name__}: {line}".strip()


def _fail(out: Path, msg: str, code: int = 2) -> int:
    (out / "result.json").write_text(json.dumps({"ok": False, "error": msg}))
    return code


def _check_architecture(config: dict) -> str | None:
    from vllm.model_executor.models import ModelRegistry

    archs = config.get("architectures") or []
    if not archs:
        return "config.json names no architectures"
    known = set(ModelRegistry.get_supported_archs())
    unknown = [a for a in archs if a not in known]
    return f"architecture {unknown[0]!r} is not one vLLM knows" if unknown else None


def _weights(llm, regions: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each projection's weight (out, in), read back through the layer itself, and the
    projections that add a bias (path -> why that matters).

    vLLM's CPU linear packs weights for oneDNN and leaves `weight` empty, so the weight is
    recovered from the layer applied to zero and to the identity: y(0) is the bias, y(I) - y(0)
    the transposed weight (exact in fp32). A projection with a bias is not the bias-free
    projection of most region Programs, so its regions are reported unsupported (`_unsupported`)
    unless the matcher found the bias (a `_bias` kind, whose Program adds it).
    """
    paths = sorted({ref["param"] for r in regions for ref in r["inputs"] if "param" in ref})

    def grab(model):
        import torch

        from prism_serve.capture.regions import EXPERTS_WEIGHTS, PLAIN_EXPERTS

        dtype = next(model.parameters()).dtype
        mods = dict(model.named_modules())

        def module(traced: str):
            # Dynamo names a module reached through a bound method (vLLM's Transformers backend)
            # `mlp.forward.__self__.gate_up_proj`; named_modules() calls it `mlp.gate_up_proj`
            plain = traced.replace(".forward.__self__", "")
            return next((m for k, m in mods.items() if k == plain or k.endswith(f".{plain}")), None)

        found, biased = {}, {}
        for path in paths:
            owner, _, attr = path.rpartition(".")
            if attr in EXPERTS_WEIGHTS:  # a MoE layer's stacked weight, as `_keep_plain_experts` kept it
                # on the layer that loads them: the traced module's own (FusedMoE) or one inside it
                # (vLLM's MoERunner holds the RoutedExperts that do)
                traced = module(owner)
                held = [getattr(m, PLAIN_EXPERTS) for m in traced.modules()
                        if hasattr(m, PLAIN_EXPERTS)] if traced is not None else []
                kept = held[0] if len(held) == 1 else {}
                if attr in kept:
                    found[path] = kept[attr]
                continue
            mod = module(path)
            if mod is None:
                continue
            b = getattr(mod, "bias", None)
            w = getattr(mod, "weight", None)
            if w is not None and w.dim() == 2 and w.numel() > 0:
                found[path], bias = w.detach().clone().cpu(), b
            else:
                n = int(mod.input_size_per_partition)
                with torch.no_grad():  # in the layer's own dtype: exact without a bias (products with 1)
                    y = mod(torch.cat([torch.zeros(1, n), torch.eye(n)]).to(getattr(mod, "params_dtype", dtype)))
                y = y[0] if isinstance(y, tuple) else y
                found[path], bias = (y[1:] - y[:1]).t().contiguous().cpu(), y[0]
            if bias is not None and bias.numel() > 0 and bool(bias.detach().abs().max() > 0):
                biased[path] = f"{path} adds a bias, which the region's Program has no input for"
        return found, biased

    res = llm.apply_model(grab)
    return res[0] if isinstance(res, list) else res


def _keep_plain_experts() -> None:
    """Make each MoE layer vLLM's CPU experts load keep a plain copy of its stacked weights (w13
    [E, 2I, H], w2 [E, H, I], on the CPU), taken before vLLM pads and packs them for its kernel:
    what warmup checks an experts kernel on (the plugin's `experts_hook` keeps the same copy to serve
    one). A copy of the experts' weights for the capture's short run."""
    from prism_serve.capture.regions import EXPERTS_WEIGHTS, PLAIN_EXPERTS
    from prism_serve.patch.experts_hook import cpu_experts_class

    cls = cpu_experts_class()
    if cls is None:  # not vLLM's CPU build: no fused MoE op is traced that capture would find
        return
    inner = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer) -> None:
        kept = {a: getattr(layer, a).detach().clone().cpu() for a in EXPERTS_WEIGHTS}
        inner(self, layer)
        setattr(layer, PLAIN_EXPERTS, kept)
    cls.process_weights_after_loading = process_weights_after_loading


def _unsupported(regions: list[dict], weights: dict, biased: dict[str, str]) -> None:
    """Mark the regions whose projection has a bias their kind does not add, or whose weight could
    not be read, as unsupported with the reason (in place): they are reported, never searched or stored."""
    for r in regions:
        if not r["supported"]:
            continue
        for ref in r["inputs"]:
            path = ref.get("param")
            if path is None:
                continue
            if path in biased and not r["kind"].endswith("_bias"):
                r["supported"], r["reason"] = False, biased[path]
            elif path not in weights:
                r["supported"], r["reason"] = False, f"the weight of {path} could not be read back from vLLM"
            else:
                continue
            break


# leaf modules of a decoder layer that a region kind would cover if prism matched their class
NEAR_MISS = re.compile(r"Norm|AndMul")


def _uncovered(regions: list[dict], groups: dict, keep, reason) -> list[dict]:
    """An unsupported region for each leaf module no region covers and `keep(cls)` selects."""
    covered = {m for r in regions for m in r["modules"]}
    return [{"kind": g.cls, "layer": _layer_of(path), "modules": [path], "dims": {}, "eps": None, "dtype": "float32",
             "supported": False, "reason": reason(g.cls), "inputs": [], "outputs": []}
            for path, g in groups.items() if path not in covered and keep(g.cls)]


def _not_a_target(regions: list[dict], groups: dict, runner: str, arch: str) -> list[dict]:
    """A model vLLM does not run for generation (a pooling model, an encoder) is no prism target:
    every region found, and every other leaf module of its graph (its LayerNorms, GELUs, ...,
    which no region kind names), is reported unsupported with the reason, so nothing is searched,
    stored or patched for it."""
    why = (f"{arch} runs with vLLM's {runner!r} runner; prism serves decoder generation only, so nothing "
           f"is searched, stored or patched for it")
    return [{**r, "supported": False, "reason": why} for r in regions] + _uncovered(
        regions, groups, lambda cls: True, lambda cls: why)


def _near_misses(regions: list[dict], groups: dict) -> list[dict]:
    """A decoder's norms and gated activations of classes the region finder does not match (e.g.
    LayerNorm, GeluAndMulSparse), reported unsupported rather than left out of the report."""
    return _uncovered(regions, groups, NEAR_MISS.search,
                      lambda cls: f"{cls} is not a module class prism's regions match (RMSNorm, GemmaRMSNorm, "
                                  f"SiluAndMul, GeluAndMul)")


def _layer_of(path: str) -> int | None:
    m = re.search(r"(?:^|\.)(?:layers|layer)\.(\d+)\.", "." + path)
    return int(m.group(1)) if m else None


def _group_times(prof) -> tuple[dict[str, float], float]:
    from prism_serve.capture.backend import FORWARD_RANGE, RANGE_PREFIX

    times: dict[str, float] = {}
    total = 0.0
    for ev in prof.key_averages():
        if ev.key == FORWARD_RANGE:
            total = ev.cpu_time_total
        elif ev.key.startswith(RANGE_PREFIX):
            times[ev.key[len(RANGE_PREFIX):]] = ev.cpu_time_total
    return times, total


def main(argv: list[str]) -> int:
    model_dir, out = Path(argv[0]), Path(argv[1])
    dtype = argv[2] if len(argv) > 2 else "auto"
    os.environ.update(ENV)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return _fail(out, f"cannot read {model_dir / 'config.json'}: {_one_line(exc)}")
    has_weights = any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin"))
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from prism_serve.capture import backend

        _keep_plain_experts()

        bad = _check_architecture(config)
        if bad:
            return _fail(out, bad)
        t0 = time.time()
        max_len = min(MAX_MODEL_LEN, int(config.get("max_position_embeddings") or MAX_MODEL_LEN))
        # vLLM's pooling runner needs the model's tokenizer; a decoder needs none (prompts are token ids)
        tokenizer = any((model_dir / f).is_file() for f in TOKENIZER_FILES)
        llm = LLM(model=str(model_dir), load_format="auto" if has_weights else "dummy",
                  skip_tokenizer_init=not tokenizer, max_model_len=max_len, dtype=dtype, enforce_eager=False, seed=0,
                  compilation_config={"mode": 2, "backend": "prism_serve.capture.backend.capture_backend",
                                      "ir_enable_torch_wrap": True})
    except Exception as exc:  # vLLM rejected the model or config
        return _fail(out, f"vLLM rejected the model: {_one_line(exc)}")
    runner = str(getattr(llm.llm_engine.model_config, "runner_type", "generate"))
    if runner == "pooling" and not tokenizer:
        return _fail(out, f"vLLM runs {model_dir} as a pooling model, which needs its tokenizer: the directory "
                          f"has none of {', '.join(TOKENIZER_FILES)}")
    try:
        greedy = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)

        def run(prompts, params):
            if runner == "pooling":  # one forward per prompt, no generation
                return llm.embed(prompts, use_tqdm=False)
            return llm.generate(prompts, params, use_tqdm=False)

        backend.STATE.record_pending = 2
        run([TokensPrompt(prompt_token_ids=RECORD_PROMPT[:max(1, max_len - 2)])], greedy)
        backend.STATE.num_tokens.clear()
        backend.STATE.attention_shapes.clear()
        vocab = int(config.get("vocab_size", 256))
        longest = max(1, max_len - HOT_MAX_TOKENS - 1)
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % vocab for j in range(min(n, longest))])
                   for i, n in enumerate(HOT_PROMPT_LENS)]
        params = SamplingParams(max_tokens=HOT_MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(prompts, params)
        times, total = _group_times(prof)
        st = backend.STATE
        regions = st.regions
        weights, biased = _weights(llm, regions)
        _unsupported(regions, weights, biased)
        if runner != "generate":
            regions = _not_a_target(regions, st.groups, runner, (config.get("architectures") or [""])[0])
        else:
            regions = regions + _near_misses(regions, st.groups)
        torch.save({"recorded": st.recorded, "weights": weights}, out / "record.pt")
        result = {"ok": True, "model": str(model_dir), "architecture": (config.get("architectures") or [""])[0],
                  "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
                  "load_format": "auto" if has_weights else "dummy", "runner": runner, "graph_nodes": st.graph_nodes,
                  "regions": regions, "classes": st.classes, "module_time_us": times, "forward_time_us": total,
                  "num_tokens": {str(k): v for k, v in sorted(st.num_tokens.items())},
                  "attention_shapes": [[*k, v] for k, v in sorted(st.attention_shapes.items())],
                  "recorded_num_tokens": [n for n, _ in st.recorded], "seconds": round(time.time() - t0, 2)}
        (out / "result.json").write_text(json.dumps(result))
        return 0
    except Exception as exc:
        return _fail(out, f"capture run failed: {_one_line(exc)}", 3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
