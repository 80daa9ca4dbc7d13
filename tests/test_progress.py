"""Warmup's progress off a terminal (plain lines per stage and region, a heartbeat) and its summary
table at 100 columns."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from prism_serve.cli import print_warmup_summary
from prism_serve.console import LiveProgress, NoProgress, PlainProgress, progress_for
from prism_serve.warmup import REGION_STAGES, RegionOutcome, WarmupReport


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(progress, clock: Clock) -> None:
    """The calls warmup makes for a capture and two regions, the second not searched."""
    progress("capture under vLLM", 0, 1)
    clock.now += 15.0
    for name, _ in REGION_STAGES:
        progress(f"rmsnorm_swiglu (1/2): {name}", 0, 2)
        clock.now += 2.5
    progress("rms_norm (2/2): not searched", 1, 2)
    progress("done", 2, 2)


def test_plain_progress_writes_a_line_per_stage_and_region_as_it_starts_and_ends():
    out, clock = io.StringIO(), Clock()
    progress = PlainProgress(out, prefix="warmup", heartbeat_s=3600, clock=clock)
    _drive(progress, clock)
    progress.close()
    lines = out.getvalue().splitlines()
    assert all(re.match(r"warmup +\d+\.\ds  \S", line) for line in lines), lines
    text = [line.split("s  ", 1)[1] for line in lines]
    assert text[:3] == ["capture under vLLM: started", "capture under vLLM: done in 15.0 s",
                        "rmsnorm_swiglu (1/2): started"]
    for name, _ in REGION_STAGES:
        assert f"rmsnorm_swiglu (1/2): {name}: started" in text
        assert f"rmsnorm_swiglu (1/2): {name}: done in 2.5 s" in text
    assert "rmsnorm_swiglu (1/2): done in 12.5 s" in text
    assert text.index("rmsnorm_swiglu (1/2): done in 12.5 s") < text.index("rms_norm (2/2): started")
    assert text[-1] == "done: 2/2 finished, 27.5 s in all"
    assert lines[-1].startswith("warmup    27.5s")


def test_plain_progress_beats_while_a_stage_runs():
    out = io.StringIO()
    progress = PlainProgress(out, heartbeat_s=0.05)
    progress("rmsnorm_swiglu (1/1): search", 0, 1)
    progress.detail("generated 3 designs")
    time.sleep(0.3)
    progress.close(stopped=True)
    beats = [line for line in out.getvalue().splitlines() if "running for" in line]
    assert beats and all("rmsnorm_swiglu (1/1): search: running for" in b and "generated 3 designs" in b
                         for b in beats)
    assert "rmsnorm_swiglu (1/1): stopped in" in out.getvalue().splitlines()[-1]
    n = len(out.getvalue())
    time.sleep(0.15)
    assert len(out.getvalue()) == n  # closed: no more beats


def test_progress_is_plain_off_a_terminal_or_under_ci_and_absent_when_quiet(monkeypatch):
    assert isinstance(progress_for(quiet=True), NoProgress)
    plain = progress_for()  # pytest's stderr is no terminal
    assert isinstance(plain, PlainProgress)
    plain.close()
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv("CI", "1")
    ci = progress_for()
    assert isinstance(ci, PlainProgress)
    ci.close()
    monkeypatch.delenv("CI")
    live = progress_for()
    assert isinstance(live, LiveProgress)
    live.close()


def _report() -> WarmupReport:
    design = "block grid(n,h) split+loop(k): rms_norm matmul.tf32 matmul.tf32 silu mul mul ->y"
    regions = [RegionOutcome("fused_add_rmsnorm_linear", "ab" * 12, [1], [(1, 8), (9, 128), (129, 1 << 20)],
                             design=design, verified=True, modeled_speedup=[1.66, 2.14, 1.11], status="verified",
                             reason="not measured: no GPU here (modeled only)"),
               RegionOutcome("rmsnorm_swiglu", "cd" * 12, [0, 1], [(1, 8), (9, 1 << 20)], design=design,
                             reused=True, verified=True, modeled_speedup=[1.5, 1.2], measured_speedup=[1.1, 0.9],
                             baseline="torch-eager", status="enabled", reason="1-8: measured faster than torch "
                             "eager (vLLM not installed); 9-1048576: measured slower than torch eager"),
               RegionOutcome("silu_and_mul", "ef" * 12, [0, 1], reason="not searched: the plugin serves it "
                             "inside rmsnorm_swiglu"),
               RegionOutcome("attention", None, [0, 1], reason="unsupported: paged attention is outside the IR")]
    return WarmupReport("tiny-llama", "cpu:x86_64-avx512-amx", 118.2, False, regions, "bfloat16")


def test_the_warmup_summary_fits_100_columns():
    folded = io.StringIO()
    print_warmup_summary(_report(), Console(file=folded, width=100))
    text = folded.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert all(kind in text for kind in ("fused_add_rmsnorm_linear", "rmsnorm_swiglu", "silu_and_mul", "attention"))
    assert "2. block grid(n,h)" in text and "(reused); measured against torch-eager; 1-8: measured faster" in " ".join(text.split())
    assert "1.66x, 2.14x, 1.11x" in text and "measured" in text
    wide = io.StringIO()
    print_warmup_summary(_report(), Console(file=wide, width=400))
    assert "vs vLLM measured" in wide.getvalue() and "2. block" not in wide.getvalue()  # it fits: every column
    verbose = io.StringIO()
    print_warmup_summary(_report(), Console(file=verbose, width=100), verbose=True)
    assert "┃ kernel" in verbose.getvalue() and "2. block" not in verbose.getvalue()  # every column, folded
