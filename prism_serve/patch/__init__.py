"""The vLLM plugin: registry kernels patched into vLLM at startup as `prism::` torch custom ops.

`register` is the `vllm.general_plugins` entry point (see `plugin.py` for its settings);
`table` builds the num_tokens dispatch table, `ops` defines the custom ops and their one dispatch,
`runtime` holds the state the serving path reads and writes (table, counters, packed weights),
`hooks` wires them into vLLM (IR providers, `CustomOp.register_oot`, class hooks, `packed`,
and the fusion pass of `fusion`, `patterns` and `dataflow`).
"""

from prism_serve.patch.plugin import STATUS, register, unpatch

__all__ = ("STATUS", "register", "unpatch")
