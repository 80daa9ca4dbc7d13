"""The search and fleet warmup on a real Ray cluster (#39), simulated on this machine: one
`ray.cluster_utils.Cluster` on loopback (a head of 2 CPUs without a GPU kind, and one node of 1 CPU
per fake `accelerator_type:` H100, A100), shared by every test here and shut down after.

The search on Ray finds what two local workers find, also with a worker killed by its pid mid-
search; a fleet warmup stores one set of rows per (model, GPU kind) with its device, resumes
after its driver is killed, and finishes the other kinds when a kind's node is lost. Without Ray,
`--ray` says in one line how to install it. Kept small: about a minute and a half in all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prism_serve.optimize.ir.canonical import canonical_hash
from prism_serve.optimize.pipeline.search import optimize
from prism_serve.optimize.workloads.programs import WORKLOADS
from prism_serve.registry import open_registry
from prism_serve.registry.errors import RegistryError
from prism_serve.registry.store import list_kernels

from . import fake_capture

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
KINDS = ("H100", "A100")
DEVICES = {"H100": "gpu:h100:sm9.0:132sms", "A100": "gpu:a100:sm8.0:108sms"}
WAIT_S = 120  # the longest any step here is waited for
# the fleet's search per region: WORK steps (fake_capture's Program verifies one design), and a wall-clock
# safety net that a loaded machine's Ray start-up never reaches
WORK, BUDGET_S = 30_000, 120.0


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only (ENVIRONMENT.md)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        nodes = {k: c.add_node(num_cpus=1, resources={f"accelerator_type:{k}": 1}) for k in KINDS}
        c.wait_for_nodes(timeout=WAIT_S)
        ray.init(address=c.address, log_to_driver=False)
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _worker_pids() -> list[int]:
    """The search's Ray actors on this machine (Ray titles them ray::_RayWorker...)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().startswith(b"ray::_RayWorker"):
                pids.append(int(p.name))
        except OSError:
            continue
    return sorted(pids)


def _summary(result) -> tuple:
    stats = result.stats.to_json()
    for volatile in ("workers", "search_s", "verify_s"):
        del stats[volatile]
    return stats, [canonical_hash(f.sgraph) for f in result.found], [f.design for f in result.found], \
        [[c.assignment for c in f.kernels] for f in result.found]


def test_the_search_on_ray_finds_what_two_local_workers_find_also_with_a_worker_killed(cluster):
    """Cut by its work budget (subtrees left open, resumed in later rounds): the same designs,
    hashes, instances and counts on Ray as in two local processes; killing one Ray worker by its
    pid after the first round (its paused walks lost) changes nothing: Ray restarts it and reruns
    its tasks, which replay their subtree's earlier grants."""
    prog = WORKLOADS["rmsnorm_linear"].program(hidden=64, out=32)

    def search(**kw):
        return optimize(prog, "h100", (1, 8), work=30_000, budget_s=600, top=1, workers=2, **kw)
    local = search()
    killed = []

    def kill_once(message, stats):
        if not killed and message.startswith("generated"):
            pids = _worker_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
    after_kill = search(ray=cluster[0].address, progress=kill_once)
    assert killed and local.stats.open_subtrees > 0 and local.found
    assert _summary(after_kill) == _summary(local)
    assert after_kill.stats.workers == 2


def _rows(url: str) -> dict[str, list[tuple]]:
    """Device fingerprint -> its kernels (id, program, bucket)."""
    reg = open_registry(url, readonly=True)
    try:
        with reg.read() as s:
            out: dict[str, list[tuple]] = {}
            for k in list_kernels(s):
                out.setdefault(k.device.fingerprint, []).append((k.id, k.program.hash, k.bucket_lo, k.bucket_hi))
            return out
    finally:
        reg.close()


DRIVER = """
import sys
from prism_serve.fleet import fleet_warmup
from tests.fleet.fake_capture import capture
fleet_warmup([sys.argv[1]], address=sys.argv[2], registry=sys.argv[3], budget_s=float(sys.argv[4]),
             capture=capture, workers=1, work=int(sys.argv[5]))
"""


def test_a_killed_fleet_driver_resumes_from_the_registry_without_repeating_finished_work(cluster, tmp_path):
    """The driver killed once the first (model, kind) is stored; the rerun keeps those rows (the
    same ids), stores only the kinds that were not, and ends with one set of rows per kind."""
    model, url = str(fake_capture.model_dir(tmp_path)), f"sqlite:///{tmp_path / 'registry.db'}"
    env = {**os.environ, "PRISM_SERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT),
           "TRITON_INTERPRET": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    args = [model, cluster[0].address, url, str(BUDGET_S), str(WORK)]
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *args],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "driver.err").open("w"))
    try:
        deadline = time.time() + WAIT_S
        while time.time() < deadline and driver.poll() is None:
            try:
                if _rows(url):
                    break
            except RegistryError:  # not created yet, or being created
                pass
            time.sleep(0.2)
        assert driver.poll() is None, "the driver ended before any kind was stored:\n" + \
            (tmp_path / "driver.err").read_text()[-3000:]
        driver.kill()
        driver.wait(timeout=30)
        time.sleep(3)  # Ray ends the dead driver's tasks: none stores after this
    finally:
        if driver.poll() is None:
            driver.kill()
    before = _rows(url)
    assert before and set(before) <= set(DEVICES.values())
    from prism_serve.fleet import fleet_warmup

    os.environ["PRISM_SERVE_CACHE"] = str(tmp_path / "cache")
    try:
        report = fleet_warmup([model], address=cluster[0].address, registry=url, budget_s=BUDGET_S, work=WORK,
                              capture=fake_capture.capture, workers=1)
    finally:
        del os.environ["PRISM_SERVE_CACHE"]
    after = _rows(url)
    assert set(after) == set(DEVICES.values())
    for device, rows in before.items():
        assert after[device] == rows  # finished work is kept, not redone
    by_kind = {r.kind: r for r in report.rows}
    assert set(by_kind) == set(KINDS) and all(r.status == "ok" for r in report.rows)
    for kind, device in DEVICES.items():
        assert by_kind[kind].device == device
        assert by_kind[kind].stored + by_kind[kind].held == 1 and (device not in before or by_kind[kind].held)


def test_a_fleet_warmup_stores_one_row_set_per_model_and_kind_and_survives_a_lost_node(cluster, tmp_path):
    """The A100 node removed as its task is sent: the H100's rows are stored with its device,
    modeled (no GPU here) and saying so; the A100 is reported lost in the summary. Runs last: it
    takes the A100 node away."""
    from rich.console import Console

    from prism_serve.cli import print_fleet_summary
    from prism_serve.fleet import fleet_warmup

    c, nodes = cluster
    model, url = str(fake_capture.model_dir(tmp_path)), f"sqlite:///{tmp_path / 'registry.db'}"

    def progress(message: str) -> None:
        if message.endswith("on A100: instantiate, check, store") and "A100" in nodes:
            c.remove_node(nodes.pop("A100"))
    os.environ["PRISM_SERVE_CACHE"] = str(tmp_path / "cache")
    try:
        report = fleet_warmup([model], address=c.address, registry=url, budget_s=BUDGET_S, work=WORK,
                              capture=fake_capture.capture, workers=1, progress=progress)
    finally:
        del os.environ["PRISM_SERVE_CACHE"]
    assert report.kinds == sorted(KINDS)
    rows = {r.kind: r for r in report.rows}
    assert set(rows) == set(KINDS) and len(report.rows) == len(KINDS)
    h100 = rows["H100"]
    assert h100.status == "ok" and h100.device == DEVICES["H100"] and h100.stored == 1 and not h100.measured
    assert "modeled only" in h100.reason
    assert rows["A100"].status == "lost" and "A100" in rows["A100"].reason
    assert {device: len(v) for device, v in _rows(url).items()} == {DEVICES["H100"]: 1}
    console = Console(width=200, record=True)
    print_fleet_summary(report, console)
    text = console.export_text()
    assert "not warmed: A100" in text and "modeled only" in text


@pytest.mark.parametrize("argv", [["optimize", "swiglu", "--ray", "local"], ["warmup", "--ray", "local"],
                                  ["fleet", "warmup", "tiny-llama", "--ray", "auto"]])
def test_without_ray_the_ray_option_says_in_one_line_how_to_install_it(argv, monkeypatch):
    from prism_serve.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'prism-serve[ray]'" in lines[0], result.output


def test_the_stages_a_fleet_driver_runs_once_are_warmup_stages():
    from prism_serve.fleet import DRIVER_STAGES
    from prism_serve.warmup import REGION_STAGES

    assert set(DRIVER_STAGES) < {name for name, _ in REGION_STAGES}
