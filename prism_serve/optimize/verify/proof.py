"""Stage 2 verification: an egglog proof that an sGraph computes its Program, for every
instantiation of its symbols at once.

Both sides become abstract expressions of `prism_serve.optimize.verify.algebra`: the Program (after
expanding composites) over whole tensors; the sGraph in the parallel algebra, where a load is
a `part` of a tensor per mapped grid axis / for-loop, an accumulator a reduction over the
loop's parts, a store an `assemble` (or a `replicate` where the map is None). Symbols stay
`Sym` terms; no size is ever substituted. The proof is `check(eq(sgraph_out).to(program_out))`
after a bounded schedule.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import sympy
from egglog import EGraph, eq
from egglog.bindings import EggSmolError

from prism_serve.optimize.ir.ops import OPS, Op
from prism_serve.optimize.ir.program import REDUCTIONS, Node
from prism_serve.optimize.ir.reference import expand_composites
from prism_serve.optimize.ir.sgraph import BlockKernel, SGraph, tile_shape
from prism_serve.optimize.verify import algebra as A
from prism_serve.optimize.verify.algebra import Sym, T

log = logging.getLogger(__name__)
MAX_RANK = 6
# Rounds of the rewrite schedule. Where an output is still unproven after them and the e-graph still
# grows, the proof goes on a round at a time, to twice as many: how many rounds a proof needs depends
# on the order egglog meets matches in (qk_norm_attention's fused kernel saturates after 17 rounds
# here, yet CI once found it unproven, the e-graph smaller, after 24).
ITERATIONS = 24
# That order also varies from process to process, even on one thread and with PYTHONHASHSEED fixed,
# while one process gives the same result for the same terms in the same order: qk_norm_rotary's
# one-kernel design (6 q / 2 k heads) stopped growing unproven in 3 of 40 processes (2026-12-07),
# each time proven with the terms and facts entered in the reverse order. An unproven output is
# therefore tried once more that way before the proof gives up.
ORDERS = ("forward", "reverse")


@dataclass(frozen=True)
class ProofResult:
    ok: bool
    reason: str
    seconds: float
    iterations: int = 0  # rounds of the schedule run
    enodes: int = 0  # function entries in the e-graph when the check ran
    facts: int = 0  # independence / broadcasting facts the translation asserted
    outputs: tuple[str, ...] = ()


class Unsupported(Exception):
    """The translation has no rule for a construct: the candidate is not proven."""


class _Ctx:
    """Terms built so far and the facts (independence, broadcasting) the translation knows."""

    def __init__(self, symbols: tuple[str, ...]):
        self.symbols = symbols
        self.facts: list = []

    def note(self, term: T, shape: tuple, deps: frozenset[str]) -> T:
        for i in range(1, MAX_RANK + 1):
            if i > len(shape) or shape[-i] == 1:
                self.facts.append(A.bcast(term, -i))
        for s in self.symbols:
            if s not in deps:
                self.facts.append(A.indep(term, Sym(s)))
        return term


def _const(value: float) -> T:
    return T.const(repr(float(value)))


def _neg(dim: int, rank: int) -> int:
    return dim % rank - rank


def _op(n: Node, args: list[T], shapes: list[tuple], ctx: _Ctx) -> T:
    """One IR op on abstract tensors; `shapes` are the inputs' (tile) shapes."""
    op = n.op
    if op == "const":
        return _const(n.attr("value"))
    if op in A.BINARY_OPS:
        return getattr(args[0], OPS[op].egg)(args[1])
    if op in OPS and OPS[op].expands_to:  # square: x * x
        return getattr(args[0], OPS[OPS[op].expands_to].egg)(args[0])
    if op in A.UNARY:
        return getattr(args[0], op)()
    if op == Op.MATMUL:
        return args[0].mm(args[1].tr() if n.attr("transpose_b") else args[1])
    if op in REDUCTIONS:
        d = _neg(n.attr("dim"), len(shapes[0]))
        out = args[0].max(d) if op == Op.MAX else args[0].sum(d)
        if op == Op.MEAN:
            size = shapes[0][d]  # an int, a sympy dim, or the name num_tokens (never text to evaluate)
            if not isinstance(size, sympy.Basic):
                size = sympy.Integer(size) if isinstance(size, int) else sympy.Symbol(size)
            # a symbolic extent stays an opaque constant, equal only to itself
            inv = _const(1.0 / int(size)) if size.is_Integer else T.const(f"1/({sympy.srepr(size)})")
            out = out * ctx.note(inv, (), frozenset())
        return out if n.attr("keepdim") else out.squeeze(d)
    if op in (Op.SLICE, Op.GATHER, Op.CONCAT):
        return _indexing(n, args, shapes)
    raise Unsupported(f"node '{n.name}': op {op!r} has no abstract form")


def _fixed(n: Node, shape: tuple, d: int) -> int:
    """The size of dim `d` of an operand of `n`: a slice's, gather's or concat's dims are fixed ints
    (a tile partitioned along that dim has a symbolic size and is not supported)."""
    size = shape[d]
    if isinstance(size, sympy.Basic) and size.is_Integer:
        size = int(size)
    if not isinstance(size, int) or isinstance(size, bool):
        raise Unsupported(f"node '{n.name}': dim {d} of its operand has no fixed size ({size})")
    return size


def _indexing(n: Node, args: list[T], shapes: list[tuple]) -> T:
    """A slice (stop made canonical: one past the last index taken), a gather or a concat."""
    d = _neg(n.attr("dim"), len(shapes[0]))
    if n.op == Op.SLICE:
        start, stop, step = n.attr("start"), n.attr("stop"), n.attr("step")
        count = -(-(stop - start) // step)
        return args[0].slc(d, start, start + step * (count - 1) + 1, step, _fixed(n, shapes[0], d))
    if n.op == Op.GATHER:
        return args[0].gather(args[1], d, len(shapes[1]))
    na, nb = _fixed(n, shapes[0], d), _fixed(n, shapes[1], d)
    if n.attr("interleave"):
        if na != nb:
            raise Unsupported(f"node '{n.name}': interleaved parts of sizes {na} and {nb}")
        return args[0].il(args[1], d, na)
    return args[0].cat(args[1], d, na, nb)


def program_terms(g: SGraph, ctx: _Ctx) -> dict[str, T]:
    prog = expand_composites(g.program)
    env: dict[str, T] = {}
    shapes: dict[str, tuple] = {}
    for n in prog.nodes:
        shapes[n.name] = tuple(prog.types[n.name].shape) if n.op != "const" else ()
        if n.op == "input":
            term = T.var(n.name)
        else:
            term = _op(n, [env[s] for s in n.inputs], [shapes[s] for s in n.inputs], ctx)
        env[n.name] = ctx.note(term, shapes[n.name], frozenset())
    return {o: env[o] for o in prog.outputs}


def sgraph_terms(g: SGraph, ctx: _Ctx) -> dict[str, T]:
    """Terms of the sGraph's outputs."""
    env: dict[str, T] = {n.name: T.var(n.name) for n in g.program.inputs}  # noted by program_terms
    for k in g.kernels:
        if isinstance(k, BlockKernel):
            _block(g, k, env, ctx)
        else:
            n = k.op
            shapes = [tuple(g.tensors[s].shape) for s in n.inputs]
            env[n.name] = ctx.note(_op(n, [env[s] for s in n.inputs], shapes, ctx), tuple(g.tensors[n.name].shape),
                                   frozenset())
    return {o: env[o] for o in g.program.outputs}


def _block(g: SGraph, k: BlockKernel, env: dict[str, T], ctx: _Ctx) -> None:
    types = g.block_types(k)
    loop = Sym(k.forloop) if k.forloop else None
    local: dict[str, T] = {}
    deps: dict[str, frozenset[str]] = {}
    bodies: dict[str, T] = {}  # a max accumulator's loop-body value, for its running form
    for n in k.nodes:
        shape = tuple(types[n.name].shape)
        if n.op == "load":
            decl = g.tensors[n.attr("tensor")]
            rank, term, dep = len(decl.shape), env[n.attr("tensor")], set()
            for axis, d in zip(k.grid, n.attr("imap")):
                if d is not None:
                    term, dep = term.part(d - rank, Sym(axis.symbol)), dep | {axis.symbol}
            if n.attr("fmap") is not None:
                term, dep = term.part(n.attr("fmap") - rank, loop), dep | {k.forloop}
            local[n.name], deps[n.name] = term, frozenset(dep)
        elif n.op == "accum":
            body, kind = local[n.inputs[0]], n.attr("kind")
            if kind == Op.SUM:
                term = body.red_sum(loop)
            elif kind == Op.MEAN:
                term = body.red_sum(loop) * ctx.note(T.inv_size(loop), (), frozenset())
            elif kind == Op.MAX:
                term, bodies[n.name] = body.red_max(loop), body
            else:  # rescaled_sum: sum_i x_i * exp(m_i - m_final), m_i the running max
                m = n.inputs[1]
                run = ctx.note(bodies[m].run_max(loop), tuple(types[m].shape), deps[k.by_name[m].inputs[0]])
                scale = (run - local[m]).exp()
                term = (body * scale).red_sum(loop)
            local[n.name], deps[n.name] = term, deps[n.inputs[0]] - {k.forloop}
        elif n.op == "store":
            decl = g.tensors[n.attr("tensor")]
            value, rank = local[n.inputs[0]], len(decl.shape)
            vshape = tuple(types[n.inputs[0]].shape)
            fmap = dict(n.attrs).get("fmap")
            if len(vshape) == rank - 1:  # the tile gains a unit dim (a stacked split)
                tile = tile_shape(k, decl.shape, n.attr("omap"), fmap)
                at = [i for i in range(rank) if tile[i] == 1 and tile[:i] + tile[i + 1:] == vshape]
                if not at:
                    raise Unsupported(f"kernel '{k.name}' store '{n.name}': value does not fit the tile")
                value = value.unsq(at[0] - rank)
            elif len(vshape) != rank:
                raise Unsupported(f"kernel '{k.name}' store '{n.name}': value rank differs from the tensor's")
            if fmap is not None:  # written every iteration: the loop's tiles, concatenated (loads part last)
                value = value.assemble(fmap - rank, loop)
            for axis, d in reversed(list(zip(k.grid, n.attr("omap")))):
                s = Sym(axis.symbol)
                value = value.replicate(s) if d is None else value.assemble(d - rank, s)
            env[n.attr("tensor")] = ctx.note(value, tuple(decl.shape), frozenset())
            continue
        else:
            args = []
            for s in n.inputs:
                src = k.by_name[s]
                running = (k.stages[n.name] == "loop" and src.op == "accum" and src.attr("kind") == Op.MAX)
                args.append(ctx.note(bodies[s].run_max(loop), tuple(types[s].shape), deps[src.inputs[0]])
                            if running else local[s])
            local[n.name] = _op(n, args, [tuple(types[s].shape) for s in n.inputs], ctx)
            deps[n.name] = frozenset().union(*(deps[s] | ({k.forloop} if k.stages[n.name] == "loop" else set())
                                              for s in n.inputs)) if n.inputs else frozenset()
        ctx.note(local[n.name], shape, deps[n.name])


_CACHE: dict[str, ProofResult] = {}
_CACHE_MAX = 4096  # proofs; emptied when full (a proof is a pure function of its key)


def _key(g: SGraph, iterations: int) -> str:
    return json.dumps(g.to_json(), sort_keys=True, default=str) + f"#{iterations}"


def _saturated(g: SGraph, iterations: int, order: str = ORDERS[0]):
    """The e-graph of both sides after the bounded schedule: (egraph, ctx, want and got handles
    per output), the terms and facts entered in `order` (one of ORDERS). Raises Unsupported."""
    ctx = _Ctx(tuple(g.symbols))
    want = program_terms(g, ctx)
    env = sgraph_terms(g, ctx)
    egraph = EGraph()
    sides = [("want", want), ("got", env)]
    facts = list(ctx.facts)
    if order == "reverse":
        sides.reverse()
        facts.reverse()
    handles = {side: {o: egraph.let(f"{side}_{o}", terms[o]) for o in g.program.outputs} for side, terms in sides}
    wants, gots = handles["want"], handles["got"]
    egraph.register(*facts)
    egraph.run(A.schedule(iterations))
    return egraph, ctx, wants, gots


def _release(egraph: EGraph) -> None:
    """Drop the Rust e-graph now, on this thread. egglog's EGraphState sits in a reference cycle
    (through a closure of its own), so the cyclic GC frees it later on whichever thread happens to
    run it, such as the refresh thread of warmup's progress display, where PyO3 refuses to drop an
    unsendable object ("EGraph is unsendable, but is being dropped on another thread")."""
    for state in (getattr(egraph, "_state", None), *getattr(egraph, "_state_stack", ())):
        if state is not None and hasattr(state, "egraph"):
            state.egraph = None


def _holds(egraph: EGraph, fact) -> bool:
    try:
        egraph.check(fact)
    except EggSmolError:  # the fact does not hold in the e-graph
        return False
    return True


def prove_equivalent(g: SGraph, *, iterations: int = ITERATIONS) -> ProofResult:
    """Prove every output of `g` equal to its Program's, over symbolic sizes (cached)."""
    key = _key(g, iterations)
    if key in _CACHE:
        return _CACHE[key]
    start = time.perf_counter()
    failed = list(g.program.outputs)
    for order in ORDERS:
        try:
            egraph, ctx, wants, gots = _saturated(g, iterations, order)
        except Unsupported as exc:
            return ProofResult(False, f"unsupported: {exc}", time.perf_counter() - start)
        failed = [o for o in failed if not _holds(egraph, eq(wants[o]).to(gots[o]))]
        rounds = iterations
        while failed and rounds < 2 * iterations and egraph.run(A.rounds(1)).updated:
            rounds += 1
            failed = [o for o in failed if not _holds(egraph, eq(wants[o]).to(gots[o]))]
        size = sum(n for _, n in egraph.all_function_sizes())
        _release(egraph)
        if not failed:
            break
    seconds = time.perf_counter() - start
    reason = "proven" if not failed else f"outputs {failed} not proven equal within {rounds} iterations"
    result = ProofResult(not failed, reason, seconds, rounds, size, len(ctx.facts), tuple(g.program.outputs))
    log.debug("proof of %s: %s in %.2fs", g.name, reason, seconds)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = result
    return result
