"""Stage 1 of the superoptimizer: Prism's operator-by-operator generator (see kernel.py, block.py)."""
