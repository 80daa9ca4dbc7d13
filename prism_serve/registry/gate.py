"""The one gate in front of the registry: nothing is stored that this machine has not verified.

Warmup, seeding and `registry import` pass their results through `admit`, which for each
one re-runs the egglog proof that its sGraph computes its Program (`optimize.verify`) and runs
the generated kernel, at the stored instantiation, against the torch reference on fresh random
inputs (`optimize.check`): one token and an awkward count. A result that fails either is
refused with a one-line reason, and then the whole write is.

Results from elsewhere (`imported=True`, an export) are claims: only their sGraph, program,
device, dtype, bucket and instantiation are kept. They are stored `verified`, never `enabled`,
with a reason saying so; their timings, baseline, proof and test fields are dropped, not kept
aside: a time measured on another machine is not this device's measurement, and ranking must
never see it. The proof and test fields stored are this machine's own findings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterable

from prism_serve.errors import PrismError
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.store import KernelResult, canonical_json, current_versions

log = logging.getLogger(__name__)
IMPORTED_REASON = "imported: proof and numeric check re-run here; not measured on this device"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def sgraph_key(r: KernelResult) -> str:
    """Canonical hash of the sGraph JSON (what the proof depends on)."""
    return hashlib.sha256(canonical_json(r.sgraph.to_json()).encode()).hexdigest()


def check_device() -> str:
    """Where the numeric check runs: the interpreter when TRITON_INTERPRET=1, else the GPU."""
    import torch

    from prism_serve.optimize.codegen.render import interpreting
    if interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    raise RegistryError("cannot run the numeric check: no GPU here and TRITON_INTERPRET is not 1 "
                        "(set TRITON_INTERPRET=1 to check kernels through Triton's CPU interpreter)")


class Gate:
    """Verification for one write (an import, a warmup, a seed): each sGraph is proven once and
    each (sGraph, instantiation, GPU bound) checked once, keyed by canonical hashes."""

    def __init__(self) -> None:
        self.proofs: dict[str, dict] = {}
        self.checks: dict[tuple, dict | str] = {}

    def proof(self, r: KernelResult, key: str) -> dict:
        if key not in self.proofs:
            from prism_serve.optimize.verify.proof import prove_equivalent
            try:
                p = prove_equivalent(r.sgraph)
            except Exception as exc:  # noqa: BLE001 - an sGraph from elsewhere the prover chokes on is refused
                raise RegistryError(f"the egglog proof could not run: {type(exc).__name__}: "
                                    f"{_first_line(exc)}") from None
            if not p.ok:
                raise RegistryError(f"the egglog proof does not hold here: {p.reason}")
            self.proofs[key] = {"ok": True, "reason": p.reason, "seconds": round(p.seconds, 4)}
        return self.proofs[key]

    def numeric(self, r: KernelResult, key: str) -> dict:
        from prism_serve.optimize.target.gpus import get_gpu
        from prism_serve.patch.table import CPU_BOUNDS_GPU
        bound = r.device.name if r.device.kind == "gpu" else CPU_BOUNDS_GPU
        ckey = (key, canonical_json(r.params), bound)
        if ckey not in self.checks:
            try:  # a GPU's own measured spec where the record carries one (a GPU the table lacks)
                spec = r.device.spec if r.device.kind == "gpu" and r.device.spec is not None else get_gpu(bound)
                self.checks[ckey] = self._run(r, spec)
            except PrismError as exc:
                self.checks[ckey] = f"{exc}"
            except Exception as exc:  # noqa: BLE001 - a kernel from elsewhere that cannot run is refused
                self.checks[ckey] = (f"the numeric check could not run the kernel: {type(exc).__name__}: "
                                    f"{_first_line(exc)}")
        found = self.checks[ckey]
        if isinstance(found, str):
            raise RegistryError(found)
        return found

    @staticmethod
    def _run(r: KernelResult, spec) -> dict | str:
        from prism_serve.optimize.target.instance import instantiate
        from prism_serve.optimize.verify.check import CHECK_TOKENS, check_numerics
        inst = instantiate(r.sgraph, r.params, spec)
        device = check_device()
        start = time.perf_counter()
        verdict = check_numerics(inst, device=device)
        if not verdict.ok:
            return f"the numeric check fails here: {verdict.reasons[0]}"
        return {"max_rel_error": verdict.worst_error, "num_tokens": list(CHECK_TOKENS),
                "cases": [c.name for c in verdict.cases], "params": dict(r.params),
                "device": "cpu (Triton interpreter)" if device == "cpu" else device,
                "seconds": round(time.perf_counter() - start, 3)}

    def admit(self, r: KernelResult, where: str, *, imported: bool) -> KernelResult:
        """`r` verified here, with this machine's proof and test findings; RegistryError otherwise."""
        key = sgraph_key(r)
        try:
            proof, tests = self.proof(r, key), self.numeric(r, key)
        except RegistryError as exc:
            raise RegistryError(f"{where}: {exc}") from None
        if imported:  # built and checked here: this machine's versions, not the export's claims
            return dataclasses.replace(r, versions=current_versions(), status="verified", reason=IMPORTED_REASON,
                                       modeled_us=None, measured_us=None, baseline=None, baseline_us=None,
                                       baseline_modeled_us=None, modeled_speedup=None, proof=proof,
                                       tests={"recheck": tests}, warmup_run_id=None)
        return dataclasses.replace(r, proof=r.proof | proof, tests=r.tests | {"recheck": tests})


def admit(results: Iterable[KernelResult], *, imported: bool = False) -> list[KernelResult]:
    """Every result verified here (see the module doc), in order; raises on the first that is not,
    naming it, so the caller writes all or none."""
    gate = Gate()
    out = []
    for i, r in enumerate(results):
        out.append(gate.admit(r, f"record #{i} ({r.program.name}, {r.dtype}, tokens {r.bucket[0]}-{r.bucket[1]})",
                              imported=imported))
    log.info("gate: %d results verified (%d proofs, %d numeric checks)", len(out), len(gate.proofs),
             len(gate.checks))
    return out
