"""Workloads: Programs with default shapes, and the hand-built oracle sGraphs."""
