"""The stage functions run per design, by the search driver (`search.py`) and in its worker
processes (`workers.py`): build and cost a design (`built`, `appraise`), verify it (`verify_design`:
the egglog proof, then the numeric check)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from prism_serve.errors import SGraphError
from prism_serve.optimize.generate.design import Design, build
from prism_serve.optimize.instantiate import prune
from prism_serve.optimize.instantiate.tune import best_modeled, enumerate_instances, symbol_choices
from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.ir.program import Program
from prism_serve.optimize.ir.sgraph import SGraph
from prism_serve.optimize.target.gpus import GpuSpec
from prism_serve.optimize.verify.check import NumericVerdict, check_numerics, small_program
from prism_serve.optimize.verify.proof import ProofResult, prove_equivalent

log = logging.getLogger(__name__)


def design_key(g: SGraph) -> str:
    """Identity of a design: its canonical hash (free of names and of the order of independent ops)."""
    return canonical_hash(g)


@dataclass(frozen=True)
class Appraisal:
    """What costing a design found: its canonical key (None: it does not build), the sGraph-level
    rule that drops it (``shape`` or ``hardware``), else its modeled time summed over the buckets
    and the symbol assignments it stands for. Worker processes appraise their own subtrees'
    designs (`appraise`); the driver keeps the order and drops canonical duplicates."""

    design: Design
    key: str | None
    rule: str | None = None
    us: float = math.inf
    concrete: int = 0


def appraise(prog: Program, gpu: GpuSpec, buckets: tuple[int, ...], d: Design, g: SGraph, key: str) -> Appraisal:
    """A built design through the shape and hardware rules, modeled at its best instance per bucket."""
    why = prune.shape(g)
    rule = "shape" if why else None
    if not why:
        why, rule = prune.hardware(g, gpu), "hardware"
    if why:
        return Appraisal(d, key, rule)
    best = [best_modeled(g, gpu, nt) for nt in buckets]
    if any(b is None for b in best):
        return Appraisal(d, key, "hardware")
    return Appraisal(d, key, None, sum(b.modeled_us for b in best),
                     math.prod(len(c) for c in symbol_choices(g).values()))


def built(prog: Program, d: Design) -> tuple[SGraph, str] | None:
    """The design's sGraph and canonical key, or None when it does not build."""
    try:
        g = build(prog, d)
    except SGraphError as exc:
        log.debug("design does not build: %s", exc)
        return None
    return g, design_key(g)


def _check_numerics(prog: Program, design: Design, gpu: GpuSpec):
    """The design rebuilt for small dims, at an instance that exercises every split and loop it can
    (more symbols above 1 first), through Triton on random and adversarial inputs in its dtype,
    seeded by the design's canonical hash (the same inputs whichever process checks it)."""
    g = build(small_program(prog), design)
    instances = enumerate_instances(g, gpu)
    if not instances:
        raise SGraphError(f"design of '{prog.name}' has no instance at the small check dims")
    inst = max(instances, key=lambda i: (sum(v > 1 for v in i.values.values()), -sum(i.values.values())))
    return check_numerics(inst, seed=int(canonical_hash(g)[:15], 16))


def verify_design(prog: Program, design: Design, gpu: GpuSpec) -> tuple[ProofResult, NumericVerdict | None, float]:
    """The egglog proof of the design's sGraph, then (if proven) its numeric check, and the
    seconds both took. Pure: worker processes run it (`workers.py`)."""
    t0 = time.perf_counter()
    proof = prove_equivalent(build(prog, design))
    verdict = _check_numerics(prog, design, gpu) if proof.ok else None
    return proof, verdict, time.perf_counter() - t0
