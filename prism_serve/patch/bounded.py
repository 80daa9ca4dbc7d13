"""Run a function on each of a list of items in a forked child process that can be abandoned.

What the plugin computes from registry rows at start-up (decoding an sGraph, instantiating it,
rendering and importing its Triton source) runs here first, so that no row can hang or end the
vLLM process: a CPU-bound step that holds the GIL (a huge integer power, say) cannot be
interrupted inside the process, but a child process can be killed. Each item gets `timeout_s`
from the moment the previous one answered; an item that overruns it, or that ends the child
(os._exit, a crash, running out of the memory bound), gets a reason instead of a value, and a
fresh child goes on with the next item. Values travel back as JSON (never pickle: the parent does
not trust what the child sends), one line per item.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Address space the child may add to what it inherits from vLLM: a real kernel's load needs a
# few MB; this stops a row that makes Python allocate without end before the timeout does.
CHILD_MEMORY_BYTES = 2 << 30
MAX_REPLY_BYTES = 16 << 20  # a rendered kernel module is a few KB


@dataclass(frozen=True)
class Outcome:
    """What one item gave: its value (JSON data) or why it has none."""

    value: Any = None
    error: str | None = None


def run_each(fn: Callable[[Any], Any], items: Sequence[Any], timeout_s: float,
             budget_s: float | None = None) -> list[Outcome]:
    """`fn(item)` for every item, in order, in forked children; one Outcome per item.

    `fn` must return JSON data; whatever it raises (SystemExit included) becomes the item's
    error. Past `budget_s` in all, the items left get an error without running (many slow items
    must not add up to an endless start-up). Never raises for what an item does."""
    out: dict[int, Outcome] = {}
    end = time.monotonic() + budget_s if budget_s is not None else float("inf")
    start = 0
    while start < len(items):
        if time.monotonic() >= end:
            for i in range(start, len(items)):
                out[i] = Outcome(error=f"not loaded: the {budget_s:g} s for loading all kernels were spent")
            break
        start = _one_child(fn, items, start, timeout_s, out, end)
    return [out[i] for i in range(len(items))]


def _one_child(fn, items, start: int, timeout_s: float, out: dict[int, Outcome], end: float) -> int:
    """Run items from `start` in one child until it finishes or fails, or time reaches `end`;
    the next index to run."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns, never runs the parent's exit handlers
        code = 0
        try:
            os.close(r)
            _child(fn, items, start, w)
        except BaseException:  # noqa: BLE001 - the parent reads the missing answer as a failure
            code = 1
        os._exit(code)
    os.close(w)
    buf, i = b"", start
    deadline = time.monotonic() + timeout_s
    try:
        while i < len(items):
            left = min(deadline, end) - time.monotonic()
            ready = select.select([r], [], [], left)[0] if left > 0 else []
            if not ready:
                if deadline > end:  # the whole budget ran out first: this item may be fine
                    return i
                out[i] = Outcome(error=f"took longer than {timeout_s:g} s to load")
                return i + 1
            chunk = os.read(r, 1 << 16)
            if not chunk:
                out[i] = Outcome(error=f"ended the loading process ({_status(pid)})")
                pid = 0
                return i + 1
            buf += chunk
            if len(buf) > MAX_REPLY_BYTES:
                out[i] = Outcome(error=f"its load answered more than {MAX_REPLY_BYTES} bytes")
                return i + 1
            while b"\n" in buf and i < len(items):
                line, buf = buf.split(b"\n", 1)
                out[i] = _decode(line)
                i += 1
                deadline = time.monotonic() + timeout_s
        return i
    finally:
        os.close(r)
        if pid:
            _reap(pid)


def _child(fn, items, start: int, w: int) -> None:
    _bound_memory()
    for item in items[start:]:
        try:
            reply = {"value": fn(item)}
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a payload is an answer too
            reply = {"error": _one_line(exc)}
        try:
            data = json.dumps(reply, allow_nan=False)
        except (TypeError, ValueError) as exc:
            data = json.dumps({"error": f"not JSON data: {exc}"})
        os.write(w, data.encode() + b"\n")  # a pipe write blocks until the parent reads: it is all sent


def _bound_memory() -> None:
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = current + CHILD_MEMORY_BYTES
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError):  # no /proc (not Linux): the time bound still holds
        pass


def _decode(line: bytes) -> Outcome:
    try:
        reply = json.loads(line)
    except ValueError:
        return Outcome(error="its load answered something that is not JSON")
    if not isinstance(reply, dict) or set(reply) not in ({"value"}, {"error"}):
        return Outcome(error="its load answered something that is not an outcome")
    if "error" in reply:
        return Outcome(error=str(reply["error"])[:300])
    return Outcome(value=reply["value"])


def _status(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # SIGCHLD ignored in this process: the child was reaped already
        return "status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):  # gone already, or reaped for us (SIGCHLD ignored)
        pass


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
