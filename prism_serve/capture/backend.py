"""The capture backend: vLLM hands it the model's FX graph (compilation_config backend).

It only runs inside the capture child process. It analyses the graph once
(`regions.find_regions`), wraps every leaf module's nodes in a profiler range so
a torch.profiler run attributes time per module, counts the num_tokens of every
forward call, and, when asked, records the values a region's refs point to
during one forward (an fx.Interpreter run, so in-place ops are seen in order).
State lives in one `CaptureState` object for the process.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from prism_serve.capture.regions import Group, find_regions, module_classes
from prism_serve.optimize.ir.reference import TORCH_DTYPES, TORCH_INDEX_DTYPES

log = logging.getLogger(__name__)
RANGE_PREFIX = "prism_capture:"
FORWARD_RANGE = RANGE_PREFIX + "__forward__"


@dataclass
class CaptureState:
    regions: list[dict] = field(default_factory=list)
    groups: dict[str, Group] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)  # module path -> class name (`module_classes`)
    graph_nodes: int = 0
    num_tokens: Counter = field(default_factory=Counter)
    # per forward with attention metadata: (sequences, longest query, longest kv) -> count
    attention_shapes: Counter = field(default_factory=Counter)
    record_pending: int = 0  # how many of the next forwards to record
    # per recorded forward: (num_tokens, {region index: {"inputs": [...], "outputs": [...]}})
    recorded: list[tuple[int | None, dict[int, dict[str, list[torch.Tensor]]]]] = field(default_factory=list)


STATE = CaptureState()


def _instrument(gm: fx.GraphModule, groups: dict[str, Group]) -> fx.GraphModule:
    """A copy of `gm` with a profiler range around each module group and the whole forward."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    first = {g.nodes[0]: g.path for g in groups.values()}
    last: dict[fx.Node, list[str]] = {}
    for g in groups.values():
        last.setdefault(g.nodes[-1], []).append(g.path)
    enter = torch.ops.profiler._record_function_enter_new.default
    leave = torch.ops.profiler._record_function_exit._RecordFunction
    handles: dict[str, fx.Node] = {}
    fwd = None
    for n in gm.graph.nodes:
        if n.op == "output":
            if fwd is not None:
                graph.call_function(leave, (fwd,))
            graph.node_copy(n, lambda a: env[a])
            continue
        if n.op != "placeholder" and fwd is None:
            fwd = graph.call_function(enter, (FORWARD_RANGE, None))
        if n in first:
            handles[first[n]] = graph.call_function(enter, (RANGE_PREFIX + first[n], None))
        env[n] = graph.node_copy(n, lambda a: env[a])
        for path in last.get(n, ()):
            if path in handles:
                graph.call_function(leave, (handles.pop(path),))
    return fx.GraphModule(gm, graph)


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, cloning the values the refs name at the moments they name."""

    def __init__(self, gm: fx.GraphModule, regions: list[dict]):
        super().__init__(gm)
        self.before: dict[str, list[tuple[int, str, int, dict]]] = {}
        self.after: dict[str, list[tuple[int, str, int, dict]]] = {}
        self.out: dict[int, dict[str, list[Any]]] = {}
        for i, r in enumerate(regions):
            if not r["inputs"] and not r["outputs"]:
                continue
            self.out[i] = {"inputs": [None] * len(r["inputs"]), "outputs": [None] * len(r["outputs"])}
            for side in ("inputs", "outputs"):
                for j, ref in enumerate(r[side]):
                    if "node" in ref:
                        table = self.before if ref["when"] == "before" else self.after
                        table.setdefault(ref["at"], []).append((i, side, j, ref))

    def _take(self, entries, values: dict[str, Any]) -> None:
        for i, side, j, ref in entries:
            t = values[ref["node"]].detach().clone()
            if ref.get("rows"):
                t = t.reshape(-1, t.shape[-1])
            if "shape" in ref:  # as the Program takes it (rotary: q [tokens, heads, head_dim], positions [tokens, 1])
                t = t.reshape(ref["shape"])
            if "span" in ref:
                lo, hi = ref["span"]
                t = t[..., lo:hi].contiguous()
            if "dtype" in ref:  # as the plugin hands it to the kernel (the experts' int32 ids, weights in x's dtype)
                t = t.to((TORCH_DTYPES | TORCH_INDEX_DTYPES)[ref["dtype"]])
            self.out[i][side][j] = t

    def run_node(self, n: fx.Node) -> Any:
        names = {k.name: v for k, v in self.env.items()}
        self._take(self.before.get(n.name, ()), names)
        result = super().run_node(n)
        if n.name in self.after:
            names[n.name] = result
            self._take(self.after[n.name], names)
        return result


def _num_tokens(gm: fx.GraphModule, args: tuple) -> int | None:
    for p, a in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        if "input_ids" in p.name and isinstance(a, torch.Tensor):
            return int(a.shape[0])
    return next((int(a) for a in args if isinstance(a, int)), None)


def _attention_shape() -> tuple[int, int, int] | None:
    """(sequences, longest query, longest kv) of the running forward, from vLLM's attention metadata."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            meta = meta[0] if meta else None
        if isinstance(meta, dict):
            meta = next(iter(meta.values()), None)
        if meta is None:
            return None
        batch = int(meta.query_start_loc.numel()) - 1
        return batch, int(meta.max_query_len), int(meta.max_seq_len)
    except Exception:  # another backend's metadata, or none: the histogram just lacks this forward
        return None


def capture_backend(gm: fx.GraphModule, example_inputs, *args, **kwargs):
    """Dynamo backend named in vLLM's compilation_config; returns an eager callable."""
    try:
        regions, groups = find_regions(gm.graph)
        if not STATE.regions:
            STATE.regions, STATE.groups, STATE.graph_nodes = regions, groups, len(gm.graph.nodes)
            STATE.classes = module_classes(gm.graph)
        timed = _instrument(gm, groups)
    except Exception as exc:  # never take vLLM down over analysis; report and run eagerly
        log.exception("capture analysis failed: %s", exc)
        STATE.regions = [{"kind": "analysis_error", "layer": None, "modules": [], "dims": {}, "eps": None,
                          "dtype": "float32", "supported": False, "reason": f"{type(exc).__name__}: {exc}",
                          "inputs": [], "outputs": []}]
        return gm.forward

    def run(*call_args):
        n = _num_tokens(gm, call_args)
        if n is not None:
            STATE.num_tokens[n] += 1
        shape = _attention_shape()
        if shape is not None:
            STATE.attention_shapes[shape] += 1
        if STATE.record_pending and gm.graph is not None and STATE.regions is regions:
            STATE.record_pending -= 1
            rec = _Recorder(gm, regions)
            result = rec.run(*call_args)
            STATE.recorded.append((n, rec.out))
            return result
        return timed(*call_args)

    return run
