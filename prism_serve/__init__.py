"""prism-serve: symbolic kernel superoptimizer for vLLM endpoints."""
__version__ = "0.1.0"
