"""Test-wide setup: Triton kernels run through the CPU interpreter unless told otherwise, and the
files that take minutes run first."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any import of triton

# Files that take minutes each (vLLM processes, warmups): collected first, so that the parallel
# workers of scripts/test.sh (`pytest -n 2 --dist loadfile`) start them early instead of ending on them.
SLOW_FIRST = ("tests/patch/test_vllm.py", "tests/test_warmup.py", "tests/patch/test_archs.py",
              "tests/patch/test_partial_rotary.py", "tests/scripts/test_gpu_check.py")
# Ray's tests start clusters of two CPUs: collected last, so that they do not run beside the warmups,
# whose search budgets they would eat
LAST = ("tests/fleet/test_ray.py",)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)} | {path: len(SLOW_FIRST) + 1 for path in LAST}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))  # stable: file order kept
