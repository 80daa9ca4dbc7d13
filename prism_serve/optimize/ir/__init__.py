"""The IR: Programs, their ops, dims, sGraphs, the typed loader of stored JSON, the torch
reference, canonical hashes and index labels."""
