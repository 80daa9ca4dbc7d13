"""Benchmark the kernel registry: best-kernel lookup latency on 10,000 kernels and the time to
load one device's 1,000 kernels at startup (opening the registry included).

    python scripts/bench_registry.py --json FILE [--registry PATH_OR_URL]

Kernels are real oracle sGraphs: 50 programs (5 workloads x 5 sizes x 2 dtypes) x 10 devices
x 20 num_tokens buckets. Targets: lookup median < 1 ms, device load < 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from prism_serve.optimize.target.gpus import GPUS
from prism_serve.optimize.workloads.oracles import default_assignment, oracle
from prism_serve.optimize.workloads.programs import WORKLOADS
from prism_serve.registry import DeviceInfo, KernelResult, Versions, open_registry
from prism_serve.registry.store import add_kernels, best_kernel, counts, load_device

WORKLOAD_NAMES = ("rms_norm", "fused_add_rms_norm", "rmsnorm_linear", "swiglu", "rmsnorm_mlp")
HIDDEN = (256, 512, 1024, 2048, 4096)
DTYPES = ("float16", "bfloat16")
BUCKETS = [(1, 1)] + [(2 ** (i - 1) + 1, 2 ** i) for i in range(1, 20)]
VERSIONS = Versions(torch="2.13.0", triton="3.8.0", vllm="0.32.0", prism="0.1.0")
TARGET_LOOKUP_US, TARGET_LOAD_S = 1000.0, 0.5


def devices() -> list[DeviceInfo]:
    base = [DeviceInfo.from_spec(g) for g in GPUS.values()] + [DeviceInfo.cpu()]
    variants = [DeviceInfo("gpu", f"{g.name}-variant", f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                           g.sms - 18) for g in GPUS.values()] + [DeviceInfo.cpu("aarch64")]
    return (base + variants)[:10]


def programs():
    out = []
    for w in WORKLOAD_NAMES:
        for h in HIDDEN:
            for dt in DTYPES:
                prog = WORKLOADS[w].program(hidden=h, dtype=dt)
                g = oracle(prog)
                out.append((prog, g, default_assignment(g), dt))
    return out


def fill(reg, progs, devs) -> float:
    rng = random.Random(0)
    t0 = time.perf_counter()
    with reg.write() as s:
        add_kernels(s, (KernelResult(
            program=prog, sgraph=g, device=dev, dtype=dt, bucket=(lo, hi), params=params, versions=VERSIONS,
            status="enabled", reason="benchmark", modeled_us=rng.uniform(5, 50), measured_us=rng.uniform(5, 50),
            baseline="vllm", baseline_us=60.0) for prog, g, params, dt in progs for dev in devs for lo, hi in BUCKETS))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--registry", help="path or SQLAlchemy URL of an empty registry (default: a temp file)")
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    location = args.registry or str(Path(tmp.name) / "bench.db")
    progs, devs = programs(), devices()
    reg = open_registry(location)
    fill_s = fill(reg, progs, devs)
    with reg.read() as s:
        total = counts(s)["kernels"]
    reg.close()

    reg = open_registry(location)
    rng = random.Random(1)
    times = []
    with reg.read() as s:
        for _ in range(args.lookups):
            prog, _, _, dt = rng.choice(progs)
            dev, (lo, hi) = rng.choice(devs), rng.choice(BUCKETS)
            n = rng.randint(lo, hi)
            t0 = time.perf_counter()
            k = best_kernel(s, prog.canonical_hash, dt, dev, n)
            times.append(time.perf_counter() - t0)
            assert k is not None and k.bucket_lo <= n <= k.bucket_hi
    reg.close()
    lookup_us = statistics.median(times) * 1e6
    p99_us = sorted(times)[int(0.99 * len(times))] * 1e6

    loads = []
    for dev in devs[:5]:
        t0 = time.perf_counter()
        reg = open_registry(location)  # a fresh process at startup opens, then loads its device
        with reg.read() as s:
            got = load_device(s, dev, VERSIONS)
        loads.append(time.perf_counter() - t0)
        reg.close()
        assert len(got.usable) == 1000 and not got.skipped, (len(got.usable), len(got.skipped))
    load_s = statistics.median(loads)

    table = Table(title=f"registry benchmark: {total} kernels ({reg.engine.dialect.name})")
    for col in ("measure", "value", "target", "ok"):
        table.add_column(col)
    table.add_row("fill (10,000 upserts, one transaction)", f"{fill_s:.2f} s", "-", "")
    table.add_row("best-kernel lookup, median", f"{lookup_us:.0f} us", f"< {TARGET_LOOKUP_US:.0f} us",
                  "yes" if lookup_us < TARGET_LOOKUP_US else "NO")
    table.add_row("best-kernel lookup, p99", f"{p99_us:.0f} us", "-", "")
    table.add_row("open + load one device (1,000 kernels), median of 5", f"{load_s:.3f} s",
                  f"< {TARGET_LOAD_S} s", "yes" if load_s < TARGET_LOAD_S else "NO")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"lookup_median_us": round(lookup_us, 1), "load_device_s": round(load_s, 4),
                                         "lookup_p99_us": round(p99_us, 1), "fill_s": round(fill_s, 2),
                                         "kernels": total, "backend": reg.engine.dialect.name}, indent=1))


if __name__ == "__main__":
    main()
