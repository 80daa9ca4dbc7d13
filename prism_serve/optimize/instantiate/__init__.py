"""Instantiation: the cost model, tuning, ptxas's static check, device timing and bandwidth,
and the sGraph-level pruning rules."""
