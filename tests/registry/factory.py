"""Kernel results built from the real oracle sGraphs, for registry tests and the benchmark."""

from __future__ import annotations

import functools

from prism_serve.optimize.target.gpus import GPUS
from prism_serve.optimize.workloads.oracles import default_assignment, oracle
from prism_serve.optimize.workloads.programs import WORKLOADS
from prism_serve.registry.store import DeviceInfo, KernelResult, Versions

VERSIONS = Versions(torch="2.13.0", triton="3.8.0", vllm="0.32.0", prism="0.1.0")
DEVICES = tuple(DeviceInfo.from_spec(GPUS[n]) for n in ("h100", "h200", "a100", "l40s")) + (DeviceInfo.cpu(),)
SIZED = ("rms_norm", "fused_add_rms_norm", "rmsnorm_linear", "swiglu", "rmsnorm_mlp")


@functools.cache
def program_and_sgraph(workload: str = "rms_norm", hidden: int = 1024, dtype: str = "float16"):
    prog = WORKLOADS[workload].program(hidden=hidden, dtype=dtype)
    g = oracle(prog)
    return prog, g, default_assignment(g)


def result(workload: str = "rms_norm", hidden: int = 1024, dtype: str = "float16", device: DeviceInfo = DEVICES[1],
           bucket: tuple[int, int] = (1, 16), measured_us: float | None = 10.0, status: str = "enabled",
           versions: Versions = VERSIONS, **kw) -> KernelResult:
    prog, g, params = program_and_sgraph(workload, hidden, dtype)
    return KernelResult(program=prog, sgraph=g, device=device, dtype=dtype, bucket=bucket, params=kw.pop("params", params),
                        versions=versions, status=status, reason=kw.pop("reason", "measured faster"),
                        modeled_us=kw.pop("modeled_us", 12.0), measured_us=measured_us,
                        baseline=kw.pop("baseline", "vllm"), baseline_us=kw.pop("baseline_us", 20.0),
                        proof=kw.pop("proof", {"egglog": "proved", "seconds": 0.02}),
                        tests=kw.pop("tests", {"random_inputs": 3, "max_abs_err": 1e-3}),
                        sources=kw.pop("sources", (("tiny-llama", "model.layers.0.input_layernorm"),)), **kw)
