"""The superoptimizer, one package per stage; imports run one way (`tests/test_imports.py`):
ir -> target -> codegen -> instantiate -> verify -> generate -> pipeline."""
