"""Test-wide setup: Triton kernels run through the CPU interpreter unless told otherwise."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any import of triton
