"""Static GPU facts without a GPU: compile an instance's generated kernels for an NVIDIA target
and read what ptxas made of them.

Triton compiles for `GPUTarget("cuda", cc, 32)` on any machine; the wheel ships `cuobjdump`
(registers, stack = spill bytes per thread, shared memory) and `nvdisasm` (SASS, where
tensor-core instructions are counted: HGMMA is Hopper's warpgroup MMA, HMMA the warp-level
one). Arguments are specialised as Triton's launcher specialises contiguous tensors: pointers
16-byte aligned, unit strides constant, strides that are multiples of 16 marked so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from prism_serve.errors import CodegenError
from prism_serve.optimize.ir.sgraph import TOKENS, BlockKernel
from prism_serve.optimize.target.instance import Instance

TRITON_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32", "int64": "*i64"}


@dataclass(frozen=True)
class KernelFacts:
    """What ptxas reports for one compiled block kernel."""

    kernel: str
    capability: int  # e.g. 90
    num_warps: int
    registers: int  # per thread
    stack_bytes: int  # per thread: spills (and local arrays)
    local_bytes: int
    shared_bytes: int  # per block, static + Triton's dynamic
    hgmma: int
    hmma: int

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0

    @property
    def tensor_core_instructions(self) -> int:
        return self.hgmma + self.hmma


def facts_json(facts: Sequence[KernelFacts] | None) -> list[dict] | None:
    """Facts as stored beside a kernel (None: not compiled)."""
    return None if facts is None else [asdict(f) for f in facts]


def _tool(name: str) -> str:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise CodegenError(f"{name} not found at {path}: the Triton wheel ships it for NVIDIA targets")
    return str(path)


def compiler_versions() -> dict[str, str]:
    """The Triton and ptxas that compile_facts uses: registers and spills differ between their
    versions (the same kernel can spill under one and not another), so every fact names them."""
    from importlib.metadata import version
    ptxas = _run(_tool("ptxas"), "--version").strip().splitlines()
    return {"triton": version("triton"), "ptxas": next((ln for ln in ptxas if "release" in ln), ptxas[-1])}


def _parse_res_usage(text: str) -> dict[str, int]:
    line = next((ln for ln in text.splitlines() if "REG:" in ln), None)
    if line is None:
        raise CodegenError(f"cuobjdump printed no resource usage: {text.strip()[:200]}")
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}


def compile_facts(jobs: Sequence[tuple[Instance, int]]) -> list[list[KernelFacts]]:
    """Per (instance, capability) job, the facts of every block kernel compiled for sm_`capability`.

    Triton compiles in a child process: a process that imported Triton in interpreter mode
    (TRITON_INTERPRET=1, as tests and the CPU path do) cannot compile for a GPU."""
    from prism_serve.optimize.codegen.render import render

    with tempfile.TemporaryDirectory(prefix="prism-static-") as tmp:
        plan, kernels = [], []
        for j, (inst, cap) in enumerate(jobs):
            source = Path(tmp) / f"m{j}.py"
            source.write_text(render(inst, interpret=False))
            for k in inst.sgraph.kernels:
                if isinstance(k, BlockKernel):
                    cubin = Path(tmp) / f"m{j}_{len(kernels)}.cubin"
                    plan.append({"source": str(source), "kernel": _kernel_name(inst, k), "capability": cap,
                                 "warps": inst.warps(k), "cubin": str(cubin),
                                 "tensors": {re.sub(r"\W", "_", t): _tensor_facts(inst, t)
                                             for t in inst.sgraph.tensors}})
                    kernels.append((j, k.name, cap, inst.warps(k), cubin))
        (Path(tmp) / "plan.json").write_text(json.dumps(plan))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-m", "prism_serve.optimize.instantiate.static", str(Path(tmp) / "plan.json")],
                              capture_output=True, text=True, env=env, timeout=60 + 30 * len(plan))
        if done.returncode != 0:
            raise CodegenError(f"compiling for an NVIDIA target failed: {done.stderr.strip()[-400:]}")
        out: list[list[KernelFacts]] = [[] for _ in jobs]
        for j, name, cap, warps, cubin in kernels:
            res = _parse_res_usage(_run(_tool("cuobjdump"), "-res-usage", str(cubin)))
            sass = _run(_tool("nvdisasm"), str(cubin))
            shared = json.loads(cubin.with_suffix(".json").read_text())["shared"]
            out[j].append(KernelFacts(name, cap, warps, res.get("REG", 0), res.get("STACK", 0), res.get("LOCAL", 0),
                                      max(res.get("SHARED", 0), shared),
                                      len(re.findall(r"\bHGMMA\.", sass)), len(re.findall(r"\bHMMA\.", sass))))
        return out


def _tensor_facts(inst: Instance, name: str) -> dict:
    """dtype and contiguous strides of a kernel tensor (None where a stride depends on num_tokens)."""
    shape = inst.sgraph.tensors[name].shape
    strides = [None if any(TOKENS in s.free_symbols for s in shape[d + 1:])
               else math.prod(inst.concrete(s) for s in shape[d + 1:]) for d in range(len(shape))]
    return {"dtype": inst.sgraph.tensors[name].dtype, "strides": strides}


def _signature(arg_names: list[str], tensors: dict) -> tuple[dict, dict, dict]:
    """Triton signature, constants and divisibility hints as the launcher specialises
    contiguous tensors: aligned pointers, unit strides constant, multiples of 16 marked."""
    sig, consts, attrs = {}, {}, {}
    for i, arg in enumerate(arg_names):
        if arg == "n_tokens":
            sig[arg] = "i32"
            continue
        base, _, tail = arg.rpartition("_")
        t = tensors[base]
        if tail == "ptr":
            sig[arg] = TRITON_PTR[t["dtype"]]
            attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        stride = t["strides"][int(tail[1:])]
        if stride is None:
            raise CodegenError(f"tensor '{base}': a stride depends on num_tokens; static facts need fixed strides")
        if stride == 1:
            sig[arg], consts[arg] = "constexpr", 1
        else:
            sig[arg] = "i32"
            if stride % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _compile_plan(plan_path: str) -> None:
    """Child process: compile every kernel of the plan, writing its cubin and metadata."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    modules = {}
    for job in json.loads(Path(plan_path).read_text()):
        if job["source"] not in modules:
            spec = importlib.util.spec_from_file_location(f"prism_static_{len(modules)}", job["source"])
            modules[job["source"]] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[job["source"]])
        fn = getattr(modules[job["source"]], job["kernel"])
        sig, consts, attrs = _signature(list(fn.arg_names), job["tensors"])
        compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", job["capability"], 32),
                                  options={"num_warps": job["warps"]})
        cubin = Path(job["cubin"])
        cubin.write_bytes(compiled.asm["cubin"])
        cubin.with_suffix(".json").write_text(json.dumps({"shared": compiled.metadata.shared}))


def _kernel_name(inst: Instance, k: BlockKernel) -> str:
    from prism_serve.optimize.codegen.source import ident
    return f"{ident(inst.sgraph.name)[2:]}_{ident(k.name)[2:]}"


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise CodegenError(f"{Path(cmd[0]).name} failed: {done.stderr.strip()[:200]}")
    return done.stdout


if __name__ == "__main__":
    _compile_plan(sys.argv[1])
