"""Metrics: an agent's plain counters, their snapshot, and the Prometheus rendering of the
spec's series. No Ray: ``export_to_ray=False``."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ray_velo.metrics import GET_BUCKETS_S, AgentMetrics, prometheus_registry

#: The spec's Metrics table, as Prometheus writes the series.
SPEC_SERIES = {
    "velo_rendezvous_rdma_path_total": "counter",
    "velo_rendezvous_rdma_get_duration_seconds": "histogram",
    "velo_rendezvous_rdma_leases_reaped_total": "counter",
    "velo_rdma_registered_bytes": "gauge",
    "velo_rdma_registrations_total": "counter",
    "velo_rdma_live_regions": "gauge",
}

#: Labels a series may carry; a handle, lease id or transfer id must never become one.
ALLOWED_LABELS = {"path", "reason", "kind", "node", "pool", "le"}


def busy_owner() -> AgentMetrics:
    """An owner that answered some acquires each way, reaped leases, registered memory."""
    metrics = AgentMetrics("node-a", export_to_ray=False)
    metrics.path("chunked", "kill_switch")  # staging fallback
    metrics.path("chunked", "no_offer")
    metrics.path("chunked", "no_offer")
    metrics.path("chunked", "below_min")
    for _ in range(3):
        metrics.path("rdma", "ok")
    metrics.leases_reaped(0)  # a sweep that reaped nothing
    metrics.leases_reaped(2)
    metrics.registration("arena", 64 << 20)
    metrics.registration("external", (64 << 20) + 8192)
    metrics.set_registered((64 << 20) + 8192, live_regions=1)
    metrics.get_completed(0.0002)
    metrics.get_completed(0.003)
    metrics.get_completed(120.0)  # beyond the last bucket: only +Inf counts it
    metrics.fetched("rdma", 1 << 20, 0.01)
    metrics.fetched("chunked", 1 << 16, 0.02)
    metrics.fetched("chunked", 0, 0.001)
    metrics.set_slots(live_slots=4, staged_bytes=5 << 20)
    return metrics


def test_counts_path_decisions_with_their_reason() -> None:
    snap = busy_owner().snapshot()
    assert snap["velo_rendezvous_rdma_path_total"] == {
        "chunked/below_min": 1,
        "chunked/kill_switch": 1,
        "chunked/no_offer": 2,
        "rdma/ok": 3,
    }


def test_counts_reaped_leases_registrations_and_fetched_bytes() -> None:
    snap = busy_owner().snapshot()
    assert snap["velo_rendezvous_rdma_leases_reaped_total"] == 2
    assert snap["velo_rdma_registrations_total"] == {"arena": 1, "external": 1}
    assert snap["velo_rdma_registered_bytes"] == (64 << 20) + 8192
    assert snap["velo_rdma_live_regions"] == 1
    assert snap["velo_bytes_moved_total"] == {"rdma": 1 << 20, "chunked": 1 << 16}
    assert snap["velo_fetches_total"] == {"rdma": 1, "chunked": 2}
    assert snap["velo_live_slots"] == 4
    assert snap["velo_staged_bytes"] == 5 << 20


def test_get_durations_form_a_cumulative_histogram() -> None:
    histogram = busy_owner().snapshot()["velo_rendezvous_rdma_get_duration_seconds"]
    assert histogram["count"] == 3
    assert histogram["sum"] == pytest.approx(120.0032)
    buckets = histogram["buckets"]
    assert list(buckets) == [repr(b) for b in GET_BUCKETS_S] + ["+Inf"]
    assert buckets["0.0001"] == 0
    assert buckets["0.0005"] == 1
    assert buckets["0.005"] == 2
    assert buckets["60.0"] == 2
    assert buckets["+Inf"] == 3
    counts = list(buckets.values())
    assert counts == sorted(counts)


def test_a_get_on_a_bucket_bound_counts_in_that_bucket() -> None:
    """Prometheus buckets are ``le``: a 1 ms GET is in the 0.001 bucket."""
    metrics = AgentMetrics("n", export_to_ray=False)
    metrics.get_completed(0.001)
    buckets = metrics.snapshot()["velo_rendezvous_rdma_get_duration_seconds"]["buckets"]
    assert buckets["0.0005"] == 0 and buckets["0.001"] == 1


def test_get_histogram_keeps_counting_past_a_thousand_gets() -> None:
    """A long-lived owner: count and sum are cumulative, as a Prometheus histogram must be.

    The count used to be the length of a list trimmed to the last 1000 GETs, so it stopped
    at 1000 and its rate() read zero on a busy node.
    """
    metrics = AgentMetrics("n", export_to_ray=False)
    for _ in range(2500):
        metrics.get_completed(0.002)
    histogram = metrics.snapshot()["velo_rendezvous_rdma_get_duration_seconds"]
    assert histogram["count"] == 2500
    assert histogram["sum"] == pytest.approx(5.0)
    assert histogram["buckets"]["+Inf"] == 2500


def test_snapshot_is_plain_data() -> None:
    """The agent returns it through Ray and ``ray-velo status`` prints it: JSON and pickle."""
    snap = busy_owner().snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_snapshot_is_a_copy() -> None:
    metrics = busy_owner()
    snap = metrics.snapshot()
    metrics.path("rdma", "ok")
    metrics.registration("arena", 1)
    assert snap["velo_rendezvous_rdma_path_total"]["rdma/ok"] == 3
    assert snap["velo_rdma_registrations_total"]["arena"] == 1


def test_fresh_agent_snapshot_is_all_zero() -> None:
    snap = AgentMetrics("n", export_to_ray=False).snapshot()
    assert snap["velo_rendezvous_rdma_path_total"] == {}
    assert snap["velo_rendezvous_rdma_get_duration_seconds"]["count"] == 0
    assert snap["velo_rendezvous_rdma_leases_reaped_total"] == 0


def render(*agents: AgentMetrics) -> str:
    registry = prometheus_registry({a.node_id: a.snapshot() for a in agents})
    return generate_latest(registry).decode()


def test_prometheus_renders_every_spec_series() -> None:
    text = render(busy_owner())
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in SPEC_SERIES.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert families.get(family) == kind, f"{name} ({kind}) missing from:\n{text}"
        assert f"# TYPE {name} {kind}" in text


def test_prometheus_path_series_carries_path_and_reason() -> None:
    """The only honest answer to "did the RDMA path run": path="rdma",reason="ok"."""
    text = render(busy_owner())
    assert re.search(
        r'^velo_rendezvous_rdma_path_total\{[^}]*path="rdma",reason="ok"[^}]*\} 3\.0$',
        text,
        re.MULTILINE,
    ), text
    assert re.search(
        r'^velo_rendezvous_rdma_path_total\{[^}]*path="chunked",reason="no_offer"[^}]*\} 2\.0$',
        text,
        re.MULTILINE,
    )
    # reason="ok" is the only path="rdma" label
    assert not re.search(r'path="rdma",reason="(?!ok")', text)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_values_match_the_snapshot() -> None:
    got = samples(render(busy_owner()))
    node = ("node", "node-a")

    def value(name: str, *labels: tuple[str, str]) -> float:
        return got[(name, frozenset({node, *labels}))]

    assert value("velo_rendezvous_rdma_leases_reaped_total") == 2
    assert value("velo_rdma_registered_bytes") == (64 << 20) + 8192
    assert value("velo_rdma_registrations_total", ("kind", "arena")) == 1
    assert value("velo_rdma_registrations_total", ("kind", "external")) == 1
    assert value("velo_rdma_live_regions") == 1
    assert value("velo_rendezvous_rdma_get_duration_seconds_bucket", ("le", "0.005")) == 2
    assert value("velo_rendezvous_rdma_get_duration_seconds_bucket", ("le", "+Inf")) == 3
    assert value("velo_rendezvous_rdma_get_duration_seconds_count") == 3
    assert value("velo_rendezvous_rdma_get_duration_seconds_sum") == pytest.approx(120.0032)
    assert value("velo_bytes_moved_total", ("path", "rdma")) == 1 << 20
    assert value("velo_live_slots") == 4


def test_prometheus_keeps_nodes_apart() -> None:
    other = AgentMetrics("node-b", export_to_ray=False)
    other.path("chunked", "not_configured")
    text = render(busy_owner(), other)
    assert re.search(r'path_total\{node="node-b",path="chunked",reason="not_configured"\} 1', text)
    assert 'velo_rendezvous_rdma_leases_reaped_total{node="node-b"} 0.0' in text
    assert 'velo_rendezvous_rdma_leases_reaped_total{node="node-a"} 2.0' in text


def test_no_label_is_a_handle_or_lease_id() -> None:
    """Cardinality: labels are a fixed vocabulary, whatever handles and leases came by."""
    text = render(busy_owner())
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            for value in sample.labels.values():
                # handles print as 16 hex digits, a colon and the slot id; lease ids are ints
                assert not re.fullmatch(r"[0-9a-f]{16}:[0-9a-f]+|\d+", value), sample


def test_ray_export_stays_off_outside_ray() -> None:
    """A test or a CLI process without ``ray.init`` never creates Ray metric objects."""
    metrics = AgentMetrics("n", export_to_ray=False)
    metrics.path("rdma", "ok")
    assert metrics._ray is None


def test_the_agents_timer_refreshes_every_gauge(tmp_path: Path) -> None:
    """Gauges are set at the agent's start and re-set on its timer, whatever changed them."""
    from ray_velo.metrics import GAUGE_REFRESH_S
    from ray_velo.testing import AgentPair

    with AgentPair(tmp_path / "shm") as pair:
        owner = pair.owner
        start = owner.core.metrics.snapshot()
        assert start["velo_rdma_budget_bytes"] == owner.core.memory.budget.budget_bytes > 0
        assert start["velo_live_slots"] == 0
        due = owner.tick(pair.clock())
        assert due is not None and due <= pair.clock() + GAUGE_REFRESH_S
        handle = pair.put(b"x" * (1 << 20))
        pair.tick(GAUGE_REFRESH_S)
        snap = owner.core.metrics.snapshot()
        assert snap["velo_live_slots"] == 1 and snap["velo_staged_bytes"] == 1 << 20
        assert snap["velo_arenas"]["registered"] >= 1
        assert snap["velo_rdma_live_regions"] == snap["velo_arenas"]["registered"]
        assert snap["velo_rdma_registered_bytes"] == owner.core.memory.budget.registered_bytes
        assert pair.fetch(handle) == b"x" * (1 << 20)
