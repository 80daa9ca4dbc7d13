"""The vLLM general plugin: load this device's kernels from the registry and patch them in.

vLLM calls `register()` (entry point `prism_serve` in group `vllm.general_plugins`) in every
process it starts, possibly more than once. It never raises into vLLM, does its work once per
process, and logs exactly one line saying what it patched or why it patched nothing.

Settings (environment):
- PRISM_SERVE_DISABLE=1   do nothing at all;
- PRISM_SERVE_FORCE=1     also use kernels that are only 'verified' (not measured faster), for
                          tests on the CPU through the Triton interpreter;
- PRISM_SERVE_REGISTRY    the registry (same setting as the CLI);
- PRISM_SERVE_COUNTERS    a file that receives per-op call counts as JSON at exit.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

# vLLM configures the "vllm" logger tree (format, level, destination); logging under it puts
# prism's one line among vLLM's own start-up lines, where a user reading the log looks.
log = logging.getLogger("vllm.prism_serve")
DISABLE_ENV, FORCE_ENV = "PRISM_SERVE_DISABLE", "PRISM_SERVE_FORCE"
FALSE = ("", "0", "false", "no", "off")


@dataclass
class Status:
    """What the plugin did in this process (for tests, the doctor and the benchmark)."""

    state: str = "not run"  # "patched" | "nothing" | "disabled" | "error"
    message: str = ""
    device: str | None = None
    patched: list[str] = field(default_factory=list)
    kernels: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    seconds: float = 0.0
    installed: object | None = field(default=None, repr=False)  # the hooks.Installed, owning the runtime


STATUS = Status()


def flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in FALSE


def register() -> None:
    """vLLM's entry point. Idempotent; every failure becomes one warning and an unpatched vLLM."""
    if STATUS.state != "not run":
        return
    start = time.perf_counter()
    refused: list[tuple[int, str]] = []
    try:
        state, message = _register(refused)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - anything here (SystemExit too) would take vLLM down
        state, message = "error", f"prism-serve: nothing patched, the plugin failed: {_line(exc, True)}"
    STATUS.state, STATUS.message, STATUS.seconds = state, message, time.perf_counter() - start
    _logging_ready()
    for kernel_id, why in refused:
        log.warning("prism-serve: refused kernel %d: %s; vLLM's own path serves its shapes", kernel_id, why)
    (log.info if state in ("patched", "nothing", "disabled") else log.warning)("%s", message)


def _logging_ready() -> None:
    """vLLM loads plugins before it configures logging: apply its default configuration (from
    the same VLLM_* settings, or none where VLLM_CONFIGURE_LOGGING=0) so the line is not lost;
    vLLM applies its full configuration again right after."""
    if logging.getLogger("vllm").handlers:
        return
    try:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
        configure_logging_if_needed(LoggingConfig())
    except Exception as exc:  # noqa: BLE001 - then the line goes wherever Python's logging sends it
        log.debug("cannot apply vLLM's logging configuration: %s", exc)


@dataclass
class Plan:
    """What the plugin would patch: the dispatch table, or why there is none."""

    state: str  # "ready" | "nothing" | "error"
    message: str  # the log line when there is no table
    device: str
    where: str
    which: str
    table: object | None = None  # prism_serve.patch.table.Table
    reasons: Counter = field(default_factory=Counter)  # skipped kernels: reason -> count


def plan(url: str | None = None, device=None, device_type: str | None = None, force: bool | None = None) -> Plan:
    """Read this device's kernels from the registry and build their dispatch table (no vLLM hooks).

    Defaults: the configured registry, the device vLLM runs on, $PRISM_SERVE_FORCE. Never raises
    for a registry problem: the Plan says what went wrong."""
    from prism_serve.registry.db import describe, open_registry, resolve_url
    from prism_serve.registry.errors import MissingRegistry, RegistryError
    from prism_serve.registry.store import explain, load_device

    url = resolve_url(url)
    where = describe(url)
    if device is None:
        from prism_serve.patch.device import current_device
        device, device_type = current_device()
    force = flag(FORCE_ENV) if force is None else force
    which = "enabled or verified (forced)" if force else "enabled"
    out = Plan("nothing", "", device.fingerprint, where, which)
    statuses = ("enabled", "verified") if force else ("enabled",)
    try:
        reg = open_registry(url, readonly=True)
    except MissingRegistry as exc:  # "no registry at PATH": the plugin never creates one
        out.message = f"prism-serve: nothing patched: {_line(exc)} (run `prism-serve warmup`)"
        return out
    except RegistryError as exc:  # its message names the registry
        out.state, out.message = "error", f"prism-serve: nothing patched: cannot open the registry: {_line(exc)}"
        return out
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a driver's own error
        out.state, out.message = "error", f"prism-serve: nothing patched: cannot open registry {where}: {_line(exc)}"
        return out
    others: dict[str, int] = {}
    try:
        with reg.read() as session:
            loaded = load_device(session, device, statuses=statuses)
            if not loaded.usable and not loaded.skipped:  # say what the registry holds instead
                others = explain(session, device)
            table = _build(loaded.usable, device_type)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever a row makes happen, vLLM starts unpatched
        out.state, out.message = "error", f"prism-serve: nothing patched: cannot read registry {where}: {_line(exc)}"
        return out
    finally:
        reg.close()
    out.reasons = Counter(why for _, why in loaded.skipped) + Counter(why for _, why in table.skipped)
    out.table = table
    if table.ops:
        out.state = "ready"
    elif not loaded.usable and not loaded.skipped:
        held = f" (it holds: {_reasons(Counter(others))})" if others else " (it is empty)"
        if not force and any(why == "status verified" for why in others):
            held += f"; {FORCE_ENV}=1 would use the verified ones"
        out.message = f"prism-serve: nothing patched: registry {where} has no {which} kernels for {out.device}{held}"
    else:
        out.message = (f"prism-serve: nothing patched: none of the {len(loaded.usable) + len(loaded.skipped)} "
                       f"{which} kernels for {out.device} in {where} is usable: {_reasons(out.reasons)}")
    return out


def _register(refused: list[tuple[int, str]]) -> tuple[str, str]:
    """Plan and install; the kernels whose load failed go to `refused` (one log line each)."""
    if flag(DISABLE_ENV):
        return "disabled", f"prism-serve: disabled by {DISABLE_ENV}=1; nothing patched"
    p = plan()
    STATUS.device, STATUS.skipped = p.device, dict(p.reasons)
    if p.table is not None:
        refused += p.table.refused
    if p.state != "ready":
        return p.state, p.message
    from prism_serve.patch.hooks import install
    table = p.table
    installed = STATUS.installed = install(table)
    installed.runtime.write_counters_at_exit()
    STATUS.patched, STATUS.kernels = list(installed.names), table.kernels(installed.kinds)
    shapes = ", ".join(f"{op} x{n}" for op, n in table.summary().items() if op in installed.kinds)
    text = (f"prism-serve: patched {', '.join(installed.names) or 'nothing'} with {STATUS.kernels} {p.which} "
            f"kernels for {p.device} from {p.where} (shapes: {shapes})")
    if p.reasons:
        text += f"; skipped {sum(p.reasons.values())}: {_reasons(p.reasons)}"
    return ("patched" if installed.names else "nothing"), text


def _build(kernels, device_type: str):
    from prism_serve.patch.table import build_table
    return build_table(kernels, device_type)


def _reasons(reasons: Counter) -> str:
    return "; ".join(f"{why} ({n})" for why, n in reasons.most_common(4)) + (
        f"; and {len(reasons) - 4} other reasons" if len(reasons) > 4 else "")


def _line(exc: BaseException, typed: bool = False) -> str:
    text = str(exc).strip()
    if typed:
        text = f"{type(exc).__name__}: {text}" if text else ""
    return text.splitlines()[0][:300] if text else type(exc).__name__


def unpatch() -> None:
    """Undo what `register()` installed in this process (tests and the benchmark)."""
    if STATUS.installed is not None:
        STATUS.installed.revert()
    STATUS.__init__()
