"""Property: whatever a mutated export holds (types swapped, strings injected into any field, huge
numbers, deep nesting, unknown or missing keys, repeated records), `prism-serve registry import`
either refuses it with a one-line error and writes nothing, or stores rows that re-verify here;
no module generated from what it stored contains an injected string; nothing is written outside
the example's own directory. And whatever a mutated Program of the indirection ops holds (rotary's
gather, slices and concats, its int64 positions), the typed loader refuses it in one line or
returns a Program that round-trips and whose reference runs to the shapes its types say; and a
mutated rotary oracle sGraph is refused in one line, or fails to instantiate in one line, or renders
a module free of injected strings that Triton's interpreter runs."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prism_serve.errors import ProgramError, SGraphError
from prism_serve.optimize.codegen.render import compile_instance
from prism_serve.optimize.codegen.render import render
from prism_serve.optimize.ir.program import bind_shape
from prism_serve.optimize.ir.reference import evaluate, random_inputs
from prism_serve.optimize.ir.schema import NAME, program_from_json, sgraph_from_json
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import default_assignment, oracle
from prism_serve.optimize.verify.check import check_numerics
from prism_serve.optimize.verify.proof import prove_equivalent
from prism_serve.registry import open_registry
from prism_serve.registry.gate import IMPORTED_REASON
from prism_serve.registry.store import decode_sgraph, kernel_instance, list_kernels
from prism_serve.optimize.workloads.programs import qk_norm_rotary, rotary
from tests.registry.untrusted import export_doc, import_doc

OUTSIDE = "@@OUTSIDE@@"  # replaced by the example's "outside" folder, which must stay empty


def _code(marker: str) -> str:
    code = f"open({marker!r}, 'w').write('ran')".encode()
    return f"exec ((({int.from_bytes(code, 'big')}).to_bytes({len(code)}, 'big'))) or True"


STRINGS = (
    _code(f"{OUTSIDE}/a"), f"__import__('os').system('touch {OUTSIDE}/b')", f"open('{OUTSIDE}/c', 'w')",
    "9**9**9**9", "2**2**26", "x.func.mro", "1 2", "exec (1) or True", "{__import__('os')}", '"""', "\x1b]0;t\x07",
    "", " ", "abc", "num_tokens", "BT", "cdiv(num_tokens, BT)", "float32", "sum", "enabled", "x", "y.part", "1e-06",
)
VALUES = st.one_of(
    st.sampled_from(STRINGS), st.text(max_size=12),
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([10**30, 0, -1, 1, 3, 64, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from([[], {}, [1], {"k": 1}]),
    st.integers(min_value=40, max_value=3000).map(lambda n: f"@@DEEP{n}@@"),
)
# values an indirection attribute or an input may plausibly be given instead of its own
INDIRECTION_VALUES = st.one_of(
    VALUES, st.integers(min_value=-3, max_value=70), st.sampled_from(["int32", "int64", "uint8", "bool", "gather",
                                                                     "slice", "concat", "positions", "cs"]),
    st.lists(st.one_of(st.integers(-1, 70), st.just("num_tokens")), max_size=4),
)


CLAIMS = {"status": st.sampled_from(["enabled", "verified", "disabled"]),
          "reason": st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
          "measured_us": st.floats(min_value=0, max_value=1e6), "baseline_us": st.floats(min_value=0, max_value=1e6),
          "baseline": st.sampled_from(["vllm", "torch_eager"])}


@functools.cache
def base_doc() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return json.dumps(export_doc(Path(tmp)))


def _paths(data, at=()):
    """Every (container path, key) in the document."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield at, key
        yield from _paths(value, at + (key,))


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw) -> tuple[str, list[str]]:
    """(export text, the strings injected into it)."""
    doc = json.loads(base_doc())
    injected: list[str] = []
    for _ in range(draw(st.integers(1, 2))):
        at, key = draw(st.sampled_from(list(_paths(doc))))
        parent = _get(doc, at)
        kind = draw(st.sampled_from(["replace", "replace", "replace", "add key", "delete", "repeat record",
                                     "claims", "claims", "claims"]))
        records = doc.get("records")
        if kind in ("repeat record", "claims") and not (isinstance(records, list) and records
                                                          and isinstance(records[0], dict)):
            continue
        if kind == "repeat record":
            records.append(copy.deepcopy(records[0]))
        elif kind == "claims":  # well-typed claims an import must not believe: status, timings, proof
            claim = draw(st.sampled_from(list(CLAIMS)))
            records[0][claim] = draw(CLAIMS[claim])
            if isinstance(records[0][claim], str):
                injected.append(records[0][claim])
        elif kind == "add key" and isinstance(parent, dict):
            name = draw(st.sampled_from(STRINGS + ("extra", "fmap", "eps")))
            parent[name] = draw(VALUES)
            injected.append(name)
        elif kind == "delete" and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = draw(VALUES)
            if isinstance(parent[key], str):
                injected.append(parent[key])
    text = re.sub(r'"@@DEEP(\d+)@@"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), json.dumps(doc))
    return text, injected


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _check_stored(db: Path, injected: list[str], records: int) -> None:
    reg = open_registry(db)
    with reg.read() as s:
        kernels = list_kernels(s)
        assert bool(kernels) == bool(records)  # an export of no records (all deleted) stores nothing
        for k in kernels:
            assert k.status == "verified" and k.reason == IMPORTED_REASON
            assert k.measured_us is None and k.modeled_us is None and k.speedup is None
            assert prove_equivalent(decode_sgraph(k)).ok
            inst = kernel_instance(k)
            assert check_numerics(inst, tokens=(3,), seed=0).ok
            source = render(inst)
            leaked = [s for s in injected if len(s) > 2 and not NAME.fullmatch(s) and s in source]
            assert not leaked, leaked
    reg.close()


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 30)), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(example=mutated())
def test_mutated_exports_are_refused_in_one_line_or_stored_verified(example):
    text, injected = example
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        outside, home, cwd = root / "outside", root / "home", root / "cwd"
        for d in (outside, home, cwd):
            d.mkdir()
        for var, value in (("HOME", home), ("XDG_CACHE_HOME", home / ".cache"), ("TRITON_CACHE_DIR", home / ".t"),
                           ("PRISM_SERVE_CACHE", root / "cache")):
            mp.setenv(var, str(value))
        mp.delenv("PRISM_SERVE_REGISTRY", raising=False)
        mp.chdir(cwd)
        injected = [s.replace(OUTSIDE, str(outside)) for s in injected]
        got, db = import_doc(root, text.replace(OUTSIDE, str(outside)))
        assert got.exit_code in (0, 1), got.output
        event("refused" if got.exit_code else "imported")
        if got.exit_code == 1:
            assert got.output.startswith("error: ") and got.output.count("\n") == 1, got.output
            assert not db.exists() or not _stored(db)
        else:
            _check_stored(db, injected, len(json.loads(text)["records"]))
        assert _listing(outside) == [] and _listing(home) == [] and _listing(cwd) == []
        assert os.getcwd() == str(cwd)


def _stored(db: Path) -> bool:
    reg = open_registry(db)
    with reg.read() as s:
        found = bool(list_kernels(s))
    reg.close()
    return found


INDIRECTION_PROGRAMS = (rotary(3, 1, 16, 8, 9, "float16", "neox"), rotary(2, 1, 8, 8, 5, "bfloat16", "gptj"),
                        qk_norm_rotary(1, 1, 12, 8, 4, 1e-6, "float32", "gptj"))


@st.composite
def mutated_program(draw) -> str:
    """The JSON of an indirection Program with up to two attributes given small values and up to two
    fields replaced, added or deleted."""
    doc = draw(st.sampled_from(INDIRECTION_PROGRAMS)).to_json()
    tweakable = [n["attrs"] for n in doc["nodes"] if n["attrs"] and "shape" not in n["attrs"]]
    for _ in range(draw(st.integers(0, 2))):  # a small int or bool for an attribute: often still well typed
        attrs = draw(st.sampled_from(tweakable))
        attrs[draw(st.sampled_from(sorted(attrs)))] = draw(st.one_of(st.integers(-1, 17), st.booleans()))
    for _ in range(draw(st.integers(0, 2))):
        at, key = draw(st.sampled_from(list(_paths(doc))))
        parent = _get(doc, at)
        kind = draw(st.sampled_from(["replace", "replace", "add key", "delete"]))
        if kind == "add key" and isinstance(parent, dict):
            parent[draw(st.sampled_from(("extra", "step", "interleave", "dim", "start")))] = draw(INDIRECTION_VALUES)
        elif kind == "delete" and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = draw(INDIRECTION_VALUES)
    return re.sub(r'"@@DEEP(\d+)@@"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), json.dumps(doc))


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 30)) * 10, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(text=mutated_program())
def test_mutated_indirection_programs_are_refused_in_one_line_or_well_typed(text):
    try:
        prog = program_from_json(text)
    except ProgramError as exc:
        event("refused")
        assert str(exc) and "\n" not in str(exc), str(exc)
        return
    event("loaded")
    assert program_from_json(json.dumps(prog.to_json())) == prog
    values = evaluate(prog, random_inputs(prog, 3, seed=0))
    for out, value in zip(prog.outputs, values):
        assert tuple(value.shape) == bind_shape(prog.types[out].shape, 3), out


ORACLE_SGRAPHS = (oracle(rotary(3, 1, 16, 8, 9, "float16", "gptj")),
                  oracle(qk_norm_rotary(2, 1, 12, 12, 4, 1e-6, "float32", "neox")))


@st.composite
def mutated_sgraph(draw) -> tuple[str, list[str]]:
    """(the JSON of a rotary oracle with up to two block-node attributes given small values and up
    to two fields replaced, added or deleted, the strings injected)."""
    doc = draw(st.sampled_from(ORACLE_SGRAPHS)).to_json()
    tweakable = [n["attrs"] for n in doc["kernels"][0]["nodes"] if n["attrs"]]
    for _ in range(draw(st.integers(0, 2))):
        attrs = draw(st.sampled_from(tweakable))
        key = draw(st.sampled_from(sorted(attrs)))
        small = st.one_of(st.integers(-1, 17), st.booleans(), st.none())
        attrs[key] = draw(st.lists(small, min_size=2, max_size=2) if key in ("imap", "omap") else small)
    injected: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        at, key = draw(st.sampled_from(list(_paths(doc))))
        parent = _get(doc, at)
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = draw(INDIRECTION_VALUES)
            if isinstance(parent[key], str):
                injected.append(parent[key])
    return re.sub(r'"@@DEEP(\d+)@@"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), json.dumps(doc)), injected


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 30)) * 3, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(example=mutated_sgraph())
def test_mutated_rotary_sgraphs_are_refused_in_one_line_or_render_and_run(example):
    text, injected = example
    try:
        g = sgraph_from_json(text)
        inst = instantiate(g, default_assignment(g, block_tokens=4), get_gpu("h100"))
    except (SGraphError, ProgramError) as exc:
        event("refused")
        assert str(exc) and "\n" not in str(exc), str(exc)
        return
    event("rendered")
    source = render(inst)
    leaked = [s for s in injected if len(s) > 2 and not NAME.fullmatch(s) and s in source]
    assert not leaked, leaked
    prog = g.program
    outputs = compile_instance(inst)(*random_inputs(prog, 3, seed=0))
    assert [tuple(o.shape) for o in outputs] == [bind_shape(prog.types[o].shape, 3) for o in prog.outputs]
