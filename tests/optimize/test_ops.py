"""The op registry is the one definition of an IR op: an op added to a copy of it reaches every
stage (the torch reference, the generator, the egglog algebras, the Triton codegen through the
interpreter) without another module changing."""

import json
import os
import subprocess
import sys
import textwrap

from prism_serve.optimize.ir.ops import DEFINITIONS, OPS, Kind, Op, of_kind, symbols

# Run in a fresh process: the copy of the registry with `cube` must be in place before any other
# module reads it (each reads it once, at import).
CUBE_SEARCH = textwrap.dedent("""
    import json
    import re

    import torch
    from prism_serve.optimize.ir import ops

    cube = ops.OpDef("cube", ops.Kind.UNARY, 1, torch=lambda x, a: x[0] * x[0] * x[0],
                     triton="{0} * {0} * {0}", torch_source="{0} * {0} * {0}", egg="cube", tag="cube")
    ops.OPS = {**ops.OPS, "cube": cube}

    from prism_serve.optimize.codegen.render import render
    from prism_serve.optimize.ir.program import Program, node
    from prism_serve.optimize.ir.reference import evaluate
    from prism_serve.optimize.pipeline.search import optimize

    prog = Program("cube", (node("x", "input", shape=("num_tokens", 32), dtype="float32"),
                            node("c", "cube", "x"), node("y", "add", "c", "x")), ("y",))
    x = torch.randn(3, 32)
    (ref,) = evaluate(prog, [x])
    result = optimize(prog, "h100", (4,), max_kernels=1, max_block_ops=3, budget_s=300, top=1, workers=1)
    best = result.best
    source = render(best.kernel_for(4).instance)
    print(json.dumps({"reference": torch.allclose(ref, x ** 3 + x), "found": len(result.found),
                      "design": best.design.describe(), "proof": best.proof.ok,
                      "numeric_error": best.numeric_error,
                      "rendered": bool(re.search(r"= (\\w+) \\* \\1 \\* \\1$", source, re.M))}))
""")


def test_a_unary_op_added_to_a_copy_of_the_registry_reaches_every_stage():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CUBE_SEARCH], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["reference"]  # torch reference
    assert got["found"] >= 1 and "cube" in got["design"]  # enumerated by the generator
    assert got["proof"]  # proven by the egglog algebra
    assert got["rendered"] and got["design"].startswith("block")  # one Triton kernel: x * x * x in its block
    assert got["numeric_error"] < 1e-5  # that kernel, run by the interpreter, matches the reference


def test_every_op_is_defined_once_and_grouped_by_kind():
    names = [v for k, v in vars(Op).items() if k.isupper()]
    assert [d.name for d in DEFINITIONS] == list(OPS) == names and len(set(names)) == len(names)
    assert of_kind(Kind.UNARY) == ("exp", "silu", "gelu_tanh", "square", "sqrt", "rsqrt")
    assert symbols() == ("exp", "silu", "gelu_tanh", "sqrt", "rsqrt")  # square is x * x to the algebras
    for op in of_kind(Kind.UNARY, Kind.BINARY):
        d = OPS[op]
        assert d.torch and d.triton and d.torch_source and (d.egg or d.expands_to), op
