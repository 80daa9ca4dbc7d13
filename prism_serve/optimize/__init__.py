"""The superoptimizer: IR, symbolic sGraphs, Triton codegen, workloads."""
