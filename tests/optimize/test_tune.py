"""Instantiation by tuning: enumeration, cost-model ranking and the measured-winner selection."""

import pytest

from prism_serve.errors import SGraphError
from prism_serve.optimize.instantiate.cost import instance_cost, modeled_us, unfused_us
from prism_serve.optimize.instantiate.tune import (balanced_assignment, best_modeled, enumerate_instances, finest_assignment,
                                                   measure, order, rank, symbol_choices)
from prism_serve.optimize.target.gpus import get_gpu
from prism_serve.optimize.target.instance import instantiate
from prism_serve.optimize.workloads.oracles import ORACLES, oracle
from prism_serve.optimize.workloads.programs import WORKLOADS

from .kernel_check import check_instance

H100 = get_gpu("h100")


def test_enumeration_yields_only_valid_power_of_two_instances():
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=96, out=48, dtype="float32"))
    instances = enumerate_instances(g, H100)
    assert instances
    for inst in instances:
        values = inst.values
        assert all(v & (v - 1) == 0 for v in values.values())
        assert 96 % (values["F"]) == 0 and 48 % values["G"] == 0


@pytest.mark.parametrize("hidden", [128, 384, 1024])
def test_the_finest_assignment_tiles_a_dim_of_any_size_finest(hidden):
    """A dim of 128 (or 384: 128 times an odd number) has the token blocks' choices, 1 to 128: the
    finest assignment still gives its symbol the most splits (the smallest tile), and the token
    axis one token per block; the balanced one splits it into tiles of 64 or just above, not into
    the token blocks' 16."""
    g = oracle(WORKLOADS["rmsnorm_linear"].program(hidden=hidden, out=hidden, dtype="float32"))
    choices, finest, balanced = symbol_choices(g), finest_assignment(g), balanced_assignment(g)
    assert finest["BT"] == 1 and balanced["BT"] == 16
    assert finest["G"] == max(choices["G"])
    assert hidden // balanced["G"] >= 64 > hidden // (2 * balanced["G"])


@pytest.mark.parametrize("name,dims", [("rms_norm", {"hidden": 100}), ("rmsnorm_linear", {"hidden": 96, "out": 48}),
                                       ("swiglu", {"hidden": 64, "intermediate": 48})])
def test_modeled_winner_is_correct_through_the_interpreter(name, dims):
    g = oracle(WORKLOADS[name].program(**dims, dtype="float32"))
    best = rank(g, H100, 7)[0]
    check_instance(best.instance, 7, "float32")
    check_instance(best.instance, 1, "float32")


@pytest.mark.parametrize("gpu", ["h100", "h200"])
@pytest.mark.parametrize("name", sorted(ORACLES))
def test_fused_oracles_beat_the_unfused_program_in_the_model(name, gpu):
    """On the Hopper parts. On an A100 or L40S the one-loop swiglu oracle has too few blocks at 16
    tokens to pull the weights at full bandwidth, and the search picks another design there
    (test_search covers that)."""
    spec = get_gpu(gpu)
    prog = WORKLOADS[name].program()
    num_tokens = 16
    best = rank(oracle(prog), spec, num_tokens)[0]
    assert best.modeled_us < unfused_us(prog, num_tokens, spec)


def test_cost_grows_with_tokens_and_counts_launches():
    prog = WORKLOADS["rms_norm"].program()
    inst = rank(oracle(prog), H100, 16)[0].instance
    assert modeled_us(inst, 4096, H100) > modeled_us(inst, 16, H100)
    attn = oracle(WORKLOADS["attention"].program())
    costs = instance_cost(rank(attn, H100, 0)[0].instance, 0, H100)
    assert [c.name for c in costs] == ["split_kv", "combine"]


def test_no_fitting_assignment_is_a_clear_error():
    g = oracle(WORKLOADS["rms_norm"].program(hidden=2**20))
    with pytest.raises(SGraphError, match="no power-of-two assignment"):
        rank(g, H100, 1)


def test_measure_keeps_the_measured_winner_and_drops_failures():
    g = oracle(WORKLOADS["silu_and_mul"].program(intermediate=256))
    ranked = rank(g, H100, 16)

    def timer(inst, n):
        if inst.values["BT"] == ranked[0].assignment["BT"] and inst.values["G"] == ranked[0].assignment["G"]:
            raise RuntimeError("compile failure")
        return 1000.0 / inst.values["G"] + inst.values["BT"]

    timed = measure(ranked, timer, top=4)
    assert len(timed) == 3 and ranked[0].instance not in [c.instance for c in timed]
    assert [c.measured_us for c in timed] == sorted(c.measured_us for c in timed)


@pytest.mark.parametrize("name, num_tokens", [("silu_and_mul", 16), ("rmsnorm_mlp", 1), ("swiglu", 1)])
def test_descent_breaks_ties_as_rank_does(name, num_tokens):
    """Several assignments tie on modeled time here (a memory-bound row op, decode GEMMs whose
    weight traffic does not depend on the tiling). The generator stores what descent finds, so
    descent must take the tie rule too (`cost.tie_key`): before, it kept
    the first equal-time assignment it met (rmsnorm_mlp at 1 token: BT=16, not rank's BT=1)."""
    g = oracle(WORKLOADS[name].program())
    ranked = rank(g, H100, num_tokens)
    first = round(ranked[0].modeled_us, 6)
    assert sum(round(c.modeled_us, 6) == first for c in ranked) > 1  # the case has ties
    assert order(best_modeled(g, H100, num_tokens), H100) == order(ranked[0], H100)


def test_the_open_bucket_takes_the_near_tie_that_scales_to_more_tokens():
    """The last bucket's kernel serves every larger size: tuned at 8 tokens, silu_and_mul's best
    modeled instance (many one-column blocks, a hair faster) is 10x slower at 4096 tokens than one
    within NEAR_TIE of it; `rank_open` takes the latter, and is `rank` where nothing nears a tie."""
    from prism_serve.optimize.instantiate.cost import modeled_us
    from prism_serve.optimize.instantiate.tune import NEAR_TIE, PROBE_TOKENS, rank_open

    g = oracle(WORKLOADS["silu_and_mul"].program(intermediate=256, dtype="float32"))
    plain, open_ = rank(g, H100, 8), rank_open(g, H100, 8)
    assert sorted(str(c.assignment) for c in open_) == sorted(str(c.assignment) for c in plain)  # reordered only
    near = [c for c in plain if c.modeled_us <= plain[0].modeled_us * NEAR_TIE]
    at_probe = {c.instance: modeled_us(c.instance, PROBE_TOKENS, H100) for c in near}
    assert open_[0].modeled_us <= plain[0].modeled_us * NEAR_TIE
    assert at_probe[open_[0].instance] == min(at_probe.values())
    assert at_probe[plain[0].instance] > 5 * at_probe[open_[0].instance]
    assert [c.assignment for c in rank_open(g, H100, 0)] == [c.assignment for c in rank(g, H100, 0)]


def test_kernel_times_are_the_modeled_time_of_the_instance_or_none_where_it_does_not_instantiate():
    """The descent's memo adds per-kernel times checked per kernel; the full path (instantiate,
    then modeled_us) is the reference, on a split design whose split symbol two kernels share."""
    import itertools
    import random

    from prism_serve.optimize.instantiate.tune import KernelTimes, symbol_choices
    from prism_serve.optimize.workloads.designs import gqa_decode

    g = gqa_decode(WORKLOADS["attention"].program())
    choices = symbol_choices(g)
    names = list(choices)
    rng = random.Random(0)
    sample = rng.sample(list(itertools.product(*(choices[s] for s in names))), 300)
    times = KernelTimes(g, H100, 1)
    valid = 0
    for values in map(lambda v: dict(zip(names, v)), sample):
        try:
            expected = modeled_us(instantiate(g, values, H100), 1, H100)
        except SGraphError:
            expected = None
        got = times(values)
        assert got == pytest.approx(expected) if expected is not None else got is None, values
        valid += expected is not None
    assert 0 < valid < len(sample)  # both kinds of assignment were drawn


def test_descent_crosses_the_ridge_where_single_moves_stall():
    """rmsnorm_linear's 1/rms-then-projection design at 16 tokens: from the tiles one-symbol
    descent stalled at (8-token blocks, 16 output tiles, 32 loop steps; 18.39 us) no single move
    helps, while the instance of 16-token blocks, 64 output tiles and 8 loop steps models at 13.75
    us; joint moves of two symbols of one kernel reach it."""
    from prism_serve.optimize.instantiate.tune import descend
    from prism_serve.optimize.workloads.designs import rms_then_projection

    g = rms_then_projection(WORKLOADS["rmsnorm_linear"].program())
    target = modeled_us(instantiate(g, {"BR": 1, "FR": 1, "BT": 16, "G": 64, "F": 8}, H100), 16, H100)
    stall = {"BR": 1, "FR": 1, "BT": 8, "G": 16, "F": 32}
    assert modeled_us(instantiate(g, stall, H100), 16, H100) > 1.3 * target
    assert descend(g, H100, 16, stall).modeled_us <= target + 1e-9


class FakePtxas:
    """Stands in for `static.compile_facts`: every instance whose assignment is in `spilling`
    spills, those in `broken` fail to compile (alone or in a batch), and every call after the
    first `works` fails (no compiler here). Records each call's assignments."""

    def __init__(self, spilling=(), broken=(), works=None):
        self.spilling, self.broken, self.works, self.calls = list(spilling), list(broken), works, []

    def __call__(self, jobs):
        from prism_serve.errors import CodegenError
        from prism_serve.optimize.instantiate.static import KernelFacts
        self.calls.append([inst.values for inst, _ in jobs])
        if (self.works is not None and len(self.calls) > self.works) or any(i.values in self.broken for i, _ in jobs):
            raise CodegenError("compiling for an NVIDIA target failed")
        return [[KernelFacts("k", cc, 4, 40, 16 if inst.values in self.spilling else 0, 0, 0, 0, 0)]
                for inst, cc in jobs]


def _ranking(num_tokens=4):
    g = oracle(WORKLOADS["silu_and_mul"].program(intermediate=256))
    return rank(g, H100, num_tokens, enumerate_instances(g, H100))


def test_the_screen_goes_down_the_ranking_past_spilling_instances(monkeypatch):
    from prism_serve.optimize.instantiate import tune
    ranked = _ranking()
    assert len(ranked) > tune.SCREEN_DEPTH
    ptxas = FakePtxas(spilling=[c.assignment for c in ranked[:3]])
    monkeypatch.setattr(tune, "compile_facts", ptxas)
    (one,), (same,) = tune.screen([ranked, ranked], 90)
    assert one.instance is same.instance is ranked[3].instance
    assert one.facts[0].stack_bytes == 0 and one.facts[0].capability == 90
    # the top of both rankings, the shared instance once; then SCREEN_DEPTH deeper, once
    assert ptxas.calls == [[ranked[0].assignment], [c.assignment for c in ranked[1:1 + tune.SCREEN_DEPTH]]]
    two, three = tune.screen([ranked], 90, want=2)[0]
    assert (two.instance, three.instance) == (ranked[3].instance, ranked[4].instance)


def test_the_screen_keeps_the_least_spilling_instance_when_all_spill(monkeypatch):
    from prism_serve.optimize.instantiate import tune
    ranked = _ranking()[:3]
    monkeypatch.setattr(tune, "compile_facts", FakePtxas(spilling=[c.assignment for c in ranked]))
    ((kept,),) = tune.screen([ranked], 90)
    assert kept.instance is ranked[0].instance and kept.facts[0].stack_bytes == 16


def test_an_instance_that_does_not_compile_is_passed_over(monkeypatch):
    from prism_serve.optimize.instantiate import tune
    ranked = _ranking()
    ptxas = FakePtxas(spilling=[ranked[0].assignment], broken=[ranked[1].assignment])
    monkeypatch.setattr(tune, "compile_facts", ptxas)
    ((taken,),) = tune.screen([ranked], 90)
    assert taken.instance is ranked[2].instance and taken.facts is not None
    assert [ranked[1].assignment] in ptxas.calls  # retried alone after the batch failed
    # broken instances first in the deeper round do not make the compiler count as missing
    ptxas = FakePtxas(spilling=[ranked[0].assignment], broken=[c.assignment for c in ranked[1:3]])
    monkeypatch.setattr(tune, "compile_facts", ptxas)
    ((taken,),) = tune.screen([ranked], 90)
    assert taken.instance is ranked[3].instance and taken.facts is not None
    # the one deeper instance is broken: the spilling one, whose facts are known, is kept
    monkeypatch.setattr(tune, "compile_facts", FakePtxas(spilling=[ranked[0].assignment],
                                                         broken=[ranked[1].assignment]))
    ((kept,),) = tune.screen([ranked[:2]], 90)
    assert kept.instance is ranked[0].instance and kept.facts[0].stack_bytes == 16


def test_an_instance_compiled_for_another_bucket_counts(monkeypatch):
    """Two buckets rank the same two instances in opposite orders; the first spills: both take
    the clean one, compiled in the first round for the other bucket."""
    from prism_serve.optimize.instantiate import tune
    x, y = _ranking()[:2]
    monkeypatch.setattr(tune, "compile_facts", FakePtxas(spilling=[x.assignment]))
    (a,), (b,) = tune.screen([[x, y], [y, x]], 90)
    assert a.instance is b.instance is y.instance and a.facts is not None


def test_without_a_compiler_the_rankings_come_back_unchecked(monkeypatch):
    from prism_serve.optimize.instantiate import tune
    ranked = _ranking()
    monkeypatch.setattr(tune, "compile_facts", FakePtxas(works=0))
    assert tune.screen([ranked], 90, want=2) == [ranked[:2]]
    # a compiler that worked and then fails: the deeper instances count as not compiling, one by one
    ptxas = FakePtxas(spilling=[ranked[0].assignment], works=1)
    monkeypatch.setattr(tune, "compile_facts", ptxas)
    ((first,),) = tune.screen([ranked], 90, want=2)
    assert first.instance is ranked[1].instance and first.facts is not None
    assert len(ptxas.calls) == 2 + tune.SCREEN_DEPTH
    with pytest.raises(SGraphError, match="at least one"):
        tune.screen([ranked], 90, want=0)
