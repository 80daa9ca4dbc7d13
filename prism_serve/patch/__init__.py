"""The vLLM plugin: registry kernels patched into vLLM at startup as `prism::` torch custom ops.

`register` is the `vllm.general_plugins` entry point (see `plugin.py` for its settings);
`table` builds the num_tokens dispatch table, `ops` holds the custom ops and their counters,
`hooks` wires them into vLLM (IR providers, `CustomOp.register_oot`).
"""

from prism_serve.patch.plugin import STATUS, register, unpatch

__all__ = ("STATUS", "register", "unpatch")
