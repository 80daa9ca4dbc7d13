"""Where the command-line tools print: tables to stdout, progress to stderr.

Progress is a stream of stage names (`StageProgress.__call__(stage, done, total)`: the run entered
`stage`, `done` of `total` units, e.g. regions, are finished; `done >= total` is the run's last
stage). A stage named ``"group: step"`` belongs to `group` (a region); a stage without ``": "`` is
its own group. On a terminal it is Rich's
live display; elsewhere (no TTY, `CI` set, `--no-progress`) `PlainProgress` writes one line when a
stage or a group starts and ends, with elapsed seconds, and a heartbeat line while a stage runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Protocol, TextIO

from rich.console import Console

SUMMARY_WIDTH = 100  # a summary printed anywhere but a terminal fits this many columns (or $COLUMNS)
HEARTBEAT_S = 10.0  # a plain log shows a line at least this often while a stage runs


def stdout_console() -> Console:
    """Tables to stdout: the terminal's width, or 200 columns when piped (no name cut short)."""
    return Console(width=None if sys.stdout.isatty() else 200)


def summary_console() -> Console:
    """A command's summary table to stdout: the terminal's width; elsewhere `$COLUMNS`, else
    `SUMMARY_WIDTH`, so a log viewer shows it without wrapped rows."""
    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else SUMMARY_WIDTH)


class StageProgress(Protocol):
    """A progress display: called as a command's `progress` callback (see the module doc)."""

    def __call__(self, stage: str, done: int, total: int) -> None: ...

    def detail(self, text: str) -> None:
        """What the current stage is doing now (shown live, and in the next heartbeat line)."""

    def close(self, stopped: bool = False) -> None:
        """The run is over (`stopped`: by an error): end the open stage and group."""


def _group(stage: str) -> str:
    return stage.split(": ", 1)[0]


class PlainProgress:
    """One line per stage and per group as it starts and ends, prefixed by the seconds since the
    run began, and a heartbeat (the stage and its elapsed seconds) when a stage has run `heartbeat_s`
    without a line, from a daemon thread. Thread-safe; `close()` ends it."""

    def __init__(self, stream: TextIO, prefix: str = "prism-serve", heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream, self._prefix, self._clock = stream, prefix, clock
        self._start = clock()
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._group: str | None = None
        self._stage_at = self._group_at = self._last = self._start
        self._detail = ""
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()

    def _line(self, text: str) -> None:
        self._last = self._clock()
        self._stream.write(f"{self._prefix} {self._last - self._start:7.1f}s  {text}\n")
        self._stream.flush()

    def _end(self, group_too: bool, word: str = "done") -> None:
        now = self._clock()
        if self._stage is not None and self._stage != self._group:
            self._line(f"{self._stage}: {word} in {now - self._stage_at:.1f} s")
        if group_too and self._group is not None:
            self._line(f"{self._group}: {word} in {now - self._group_at:.1f} s")
            self._group = None
        self._stage = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            group = _group(stage)
            self._end(group_too=group != self._group)
            now = self._clock()
            if done >= total:  # the last stage: everything has ended
                self._line(f"{stage}: {done}/{total} finished, {now - self._start:.1f} s in all")
                return
            if group != self._group:
                self._group, self._group_at = group, now
                self._line(f"{group}: started")
            if stage != group:
                self._line(f"{stage}: started")
            self._stage, self._stage_at, self._detail = stage, now, ""

    def detail(self, text: str) -> None:
        with self._lock:
            self._detail = text

    def close(self, stopped: bool = False) -> None:
        self._stop.set()
        with self._lock:
            self._end(group_too=True, word="stopped" if stopped else "done")

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(min(every, 1.0)):
            with self._lock:
                if self._stage is not None and self._clock() - self._last >= every:
                    detail = f", {self._detail}" if self._detail else ""
                    self._line(f"{self._stage}: running for {self._clock() - self._stage_at:.0f} s{detail}")


class LiveProgress:
    """Rich's live display on a terminal: the stage, a bar over the units, the elapsed time; each
    group's end stays printed above it."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                             TimeElapsedColumn(), console=console, transient=True)
        self._task = self._bar.add_task("starting", total=1)
        self._group: str | None = None
        self._group_at = time.monotonic()
        self._stage = ""
        self._bar.start()

    def _end_group(self) -> None:
        if self._group is not None:
            self._bar.console.print(f"[green]done[/] {self._group} in {time.monotonic() - self._group_at:.1f} s",
                                    highlight=False)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if _group(stage) != self._group:
            self._end_group()
            self._group, self._group_at = _group(stage), time.monotonic()
        self._stage = stage
        self._bar.update(self._task, description=stage, completed=done, total=max(total, 1))

    def detail(self, text: str) -> None:
        self._bar.update(self._task, description=f"{self._stage} ({text})" if text else self._stage)

    def close(self, stopped: bool = False) -> None:
        if not stopped:
            self._end_group()
        self._bar.stop()


class NoProgress:
    """`--quiet`: nothing but the table."""

    def __call__(self, stage: str, done: int, total: int) -> None:
        pass

    def detail(self, text: str) -> None:
        pass

    def close(self, stopped: bool = False) -> None:
        pass


def progress_for(*, quiet: bool = False, plain: bool = False, prefix: str = "prism-serve") -> StageProgress:
    """The progress display for a command, on stderr: none with `quiet`; plain lines with `plain`
    (`--no-progress`), when stderr is no terminal or `CI` is set; else Rich's live display."""
    if quiet:
        return NoProgress()
    if plain or not sys.stderr.isatty() or os.environ.get("CI"):
        return PlainProgress(sys.stderr, prefix)
    return LiveProgress(Console(stderr=True))
