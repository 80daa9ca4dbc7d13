"""The superoptimizer: IR, symbolic sGraphs, Triton codegen, workloads."""

__all__ = ["canonical_hash"]


def __getattr__(name: str):
    # lazy: importing the package stays cheap (no sympy / egglog) until the hash is asked for
    if name == "canonical_hash":
        from prism_serve.optimize.canonical import canonical_hash
        return canonical_hash
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
