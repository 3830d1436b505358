"""Ray's metrics export as an operator's Prometheus sees it: every series of a freshly started
agent is there before it has done anything (counters at 0, gauges set), and every query of
the shipped Grafana dashboard names a series that the scrape has."""

from __future__ import annotations

import json
import re
import time
import urllib.request
import zlib
from importlib import resources

import numpy as np
import pytest

import ray_velo as rv
from ray_velo.actors import find_agent
from ray_velo.config import MiB
from ray_velo.metrics import FETCH_PATHS, PATH_LABELS, REGISTRATION_KINDS
from ray_velo.protocol.handshake import WIRE_AUTH_REASONS

from .conftest import node_ids, restart_agent

ray = pytest.importorskip("ray")

SCRAPE_BOUND_S = 45.0
GAUGES = (
    "ray_velo_rdma_registered_bytes", "ray_velo_rdma_live_regions", "ray_velo_live_slots",
    "ray_velo_staged_bytes", "ray_velo_rdma_budget_bytes",
)  # fmt: skip


@ray.remote(resources={"node_b": 1}, num_cpus=0)
def crc_on_b(handle: rv.DataHandle) -> int:
    return zlib.crc32(np.ascontiguousarray(rv.fetch(handle)))


def scrape() -> list[str]:
    """Every ray_velo sample line of every alive node's metrics export."""
    lines = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        lines += [line for line in body.splitlines() if line.startswith("ray_velo_")]
    return lines


def expected_series(node: str) -> set[str]:
    """One 'name{label=value,...}' key per series an agent exports from its start."""
    out = {f"ray_velo_rendezvous_rdma_path_total|node={node}|path={p}|reason={r}"
           for p, r in PATH_LABELS}  # fmt: skip
    out.add(f"ray_velo_rendezvous_rdma_leases_reaped_total|node={node}")
    out |= {f"ray_velo_rdma_registrations_total|kind={k}|node={node}" for k in REGISTRATION_KINDS}
    out |= {f"ray_velo_bytes_moved_total|node={node}|path={p}" for p in FETCH_PATHS}
    out |= {f"{g}|node={node}" for g in GAUGES}
    out |= {f"ray_velo_arenas|node={node}|pool={p}" for p in ("plain", "registered")}
    out |= {f"ray_velo_wire_auth_failures_total|node={node}|reason={r}" for r in WIRE_AUTH_REASONS}
    out.add(f"ray_velo_socket_auth_failures_total|node={node}")
    return out


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_OURS = {"node", "path", "reason", "kind", "pool"}


def series_keys(lines: list[str], worker_id: str) -> set[str]:
    """The series of one Ray worker (a restarted agent's predecessor may still be exported)."""
    keys = set()
    for line in lines:
        match = _SAMPLE.match(line)
        if match is None:
            continue
        found = _LABEL.findall(match.group(2))
        if ("WorkerId", worker_id) not in found:
            continue
        labels = sorted((k, v) for k, v in found if k in _OURS)
        keys.add("|".join([match.group(1), *(f"{k}={v}" for k, v in labels)]))
    return keys


def test_a_fresh_agent_exports_every_series_before_any_use(velo: None) -> None:
    restart_agent("node_b")
    node_b = node_ids()["node_b"]
    worker_id = ray.get(find_agent(node_b).status.remote())["ray_worker_id"]
    assert worker_id
    wanted = expected_series(node_b)
    deadline = time.monotonic() + SCRAPE_BOUND_S
    while True:
        missing = wanted - series_keys(scrape(), worker_id)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, sorted(missing)


def test_every_dashboard_query_names_a_series_in_the_scrape(velo: None) -> None:
    payload = np.arange(2 * MiB, dtype=np.uint8)
    assert ray.get(crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)  # the histograms
    dashboard = json.loads(
        resources.files("ray_velo").joinpath("grafana_dashboard.json").read_text()
    )
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    named = {n for q in queries for n in re.findall(r"\bray_velo_\w+", q)}
    assert len(named) >= 12, named
    deadline = time.monotonic() + SCRAPE_BOUND_S
    while True:
        exported = {line.split("{", 1)[0].split(" ", 1)[0] for line in scrape()}
        missing = named - exported
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"dashboard queries name series the export lacks: {sorted(missing)}"
