"""Metrics: the protocol's series, counted in plain integers and exported through Ray
(docs/metrics.md, docs/protocol.md §17)."""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ray_velo.protocol.handshake import WIRE_AUTH_REASONS
from ray_velo.protocol.path import (
    CONSUMER_FAILURE_REASONS,
    DEVICE_STAGING_REASONS,
    OWNER_REFUSAL_REASONS,
    STAGING_FALLBACK_REASONS,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = ["GAUGE_REFRESH_S", "GET_BUCKETS_S", "AgentMetrics", "Gauges", "prometheus_registry"]

_log = logging.getLogger(__name__)

#: How often the agent re-sets every gauge, so Ray's export never drops a quiet one (s).
GAUGE_REFRESH_S = 5.0
#: The help text of ``velo_device_staged`` (Ray's export and the standalone registry).
DEVICE_STAGED_HELP = (
    "CUDA tensors staged through host memory (one device-to-host copy) instead of a GPU "
    "arena, by reason."
)
#: Every (path, reason) pair the path counter can count: each exists at 0 from the start.
INLINE_HELP = (
    "Transparent payloads no mapped arena could take: they travelled inside the Ray call, "
    "and the agent warmed an arena up for the next one."
)
PATH_LABELS = sorted(
    {("rdma", "ok"), ("wire", "ok")}
    | {("chunked", r) for r in OWNER_REFUSAL_REASONS + CONSUMER_FAILURE_REASONS}
    | {("chunked", r) for r in STAGING_FALLBACK_REASONS}
)
#: Fetch paths of velo_bytes_moved and velo_fetch_duration_seconds ("cache": a node-local copy;
#: "wire": sent by the owner over the agents' authenticated wire).
FETCH_PATHS = ("rdma", "wire", "chunked", "cache")
REGISTRATION_KINDS = ("arena", "external")
ARENA_POOLS = ("registered", "plain")


@dataclass(frozen=True, slots=True)
class Gauges:
    """Every gauge's value, read from the agent at once (its timer refreshes them)."""

    registered_bytes: int = 0
    live_regions: int = 0
    live_slots: int = 0
    staged_bytes: int = 0
    registered_arenas: int = 0
    plain_arenas: int = 0
    budget_bytes: int = 0


#: Histogram buckets for GET and fetch durations (seconds): 100 us .. 60 s.
GET_BUCKETS_S = [1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0]


#: The help texts of the security series (Ray's export and the standalone registry).
WIRE_AUTH_HELP = (
    "TCP wire connections closed because the peer failed the handshake (it does not hold "
    "the cluster's secret or certificate, said nothing in time, or was dropped from a full "
    "queue of pending handshakes), by reason."
)
SOCKET_AUTH_HELP = "Connections to the agent's Unix socket from another user, closed unread."
#: The help text of ``velo_relay_fetches`` (Ray's export and the standalone registry).
RELAY_HELP = "Fetches whose bytes came (some or all) from a copy (another node's or this node's), not the owner."


@dataclass(frozen=True, slots=True)
class _Series:
    """One exported series: name, kind, help text, and its labels besides ``node``."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    exported_by: Literal["both", "ray", "scrape"] = "both"


#: Every series, by the key both exports hold it under, in the order a scrape lists them.
#: Ray's export times fetches (a histogram); the standalone scrape counts them.
_SERIES: dict[str, _Series] = {
    "inline": _Series("velo_transparent_inline", "counter", INLINE_HELP),
    "arenas": _Series(
        "velo_arenas", "gauge", "Arenas mapped, by pool (registered, plain).", ("pool",)
    ),
    "budget": _Series(
        "velo_rdma_budget_bytes",
        "gauge",
        "The registered-bytes budget (registered_bytes / this = budget used).",
    ),
    "path": _Series(
        "velo_rendezvous_rdma_path",
        "counter",
        "Path decisions with their reason (reason=ok is the only path=rdma and path=wire label).",
        ("path", "reason"),
    ),
    "get_duration": _Series(
        "velo_rendezvous_rdma_get_duration_seconds",
        "histogram",
        "RDMA GET time, without the acquire round trip.",
    ),
    "reaped": _Series(
        "velo_rendezvous_rdma_leases_reaped",
        "counter",
        "RDMA leases the owner reaper force-released.",
    ),
    "registered": _Series(
        "velo_rdma_registered_bytes", "gauge", "Mapped bytes, pool and external."
    ),
    "registrations": _Series(
        "velo_rdma_registrations", "counter", "Registrations, kind = arena or external.", ("kind",)
    ),
    "live_regions": _Series(
        "velo_rdma_live_regions", "gauge", "Regions the backend holds registered."
    ),
    "bytes_moved": _Series(
        "velo_bytes_moved", "counter", "Payload bytes fetched, by path.", ("path",)
    ),
    "fetches": _Series(
        "velo_fetches", "counter", "Fetches, by path.", ("path",), exported_by="scrape"
    ),
    "fetch_duration": _Series(
        "velo_fetch_duration_seconds",
        "histogram",
        "Fetch time on the consumer, acquire to last byte, by path.",
        ("path",),
        exported_by="ray",
    ),
    "relayed": _Series("velo_relay_fetches", "counter", RELAY_HELP),
    "device_staged": _Series("velo_device_staged", "counter", DEVICE_STAGED_HELP, ("reason",)),
    "live_slots": _Series("velo_live_slots", "gauge", "Slots staged on this agent."),
    "staged_bytes": _Series("velo_staged_bytes", "gauge", "Bytes staged on this agent."),
    "wire_auth_failures": _Series(
        "velo_wire_auth_failures", "counter", WIRE_AUTH_HELP, ("reason",)
    ),
    "socket_auth_failures": _Series("velo_socket_auth_failures", "counter", SOCKET_AUTH_HELP),
}


class _RayExport:
    """The ``ray.util.metrics`` twins of the counters (created only inside a Ray worker)."""

    def __init__(self, node_id: str) -> None:
        from ray.util import metrics as rm

        make = {"counter": rm.Counter, "gauge": rm.Gauge, "histogram": rm.Histogram}
        self.series: dict[str, Any] = {}
        for key, series in _SERIES.items():
            if series.exported_by == "scrape":
                continue
            extra = {"boundaries": GET_BUCKETS_S} if series.kind == "histogram" else {}
            metric = make[series.kind](
                series.name, series.help, tag_keys=(*series.labels, "node"), **extra
            )
            metric.set_default_tags({"node": node_id})
            self.series[key] = metric
        self._prime()

    def __getitem__(self, key: str) -> Any:
        return self.series[key]

    def _prime(self) -> None:
        """Every counter at 0 for each label value it can take (Ray's ``inc`` refuses 0; where
        this Ray cannot record a zero, the series appear on first use, as before)."""
        from ray_velo._ray import record_zero

        if not record_zero(self["reaped"]):
            _log.warning("ray_velo: this Ray cannot export zero counters; they appear on use")
            return
        for path, reason in PATH_LABELS:
            record_zero(self["path"], {"path": path, "reason": reason})
        for counter in (self["inline"], self["relayed"], self["socket_auth_failures"]):
            record_zero(counter)
        for reason in DEVICE_STAGING_REASONS:
            record_zero(self["device_staged"], {"reason": reason})
        for reason in WIRE_AUTH_REASONS:
            record_zero(self["wire_auth_failures"], {"reason": reason})
        for kind in REGISTRATION_KINDS:
            record_zero(self["registrations"], {"kind": kind})
        for path in FETCH_PATHS:
            record_zero(self["bytes_moved"], {"path": path})

    def set_gauges(self, gauges: Gauges) -> None:
        self["registered"].set(gauges.registered_bytes)
        self["live_regions"].set(gauges.live_regions)
        self["live_slots"].set(gauges.live_slots)
        self["staged_bytes"].set(gauges.staged_bytes)
        self["arenas"].set(gauges.registered_arenas, {"pool": "registered"})
        self["arenas"].set(gauges.plain_arenas, {"pool": "plain"})
        self["budget"].set(gauges.budget_bytes)


class AgentMetrics:
    """One agent's counters, mirrored to Ray's metrics export when inside Ray."""

    def __init__(self, node_id: str, *, export_to_ray: bool | None = None) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self.path_total: Counter[tuple[str, str]] = Counter()
        # The GET histogram as cumulative plain numbers: one count per GET_BUCKETS_S bound
        # (non-cumulative; +Inf is the last), the total count and the sum of seconds.
        self.get_duration_buckets: list[int] = [0] * (len(GET_BUCKETS_S) + 1)
        self.get_duration_count = 0
        self.get_duration_sum_s = 0.0
        self.leases_reaped_total = 0
        self.transparent_inline_total = 0
        self.registered_bytes = 0
        self.registrations_total: Counter[str] = Counter()
        self.live_regions = 0
        self.bytes_moved: Counter[str] = Counter()
        self.fetches: Counter[str] = Counter()
        self.relay_fetches_total = 0
        self.device_staged_total: Counter[str] = Counter(dict.fromkeys(DEVICE_STAGING_REASONS, 0))
        self.wire_auth_failures: Counter[str] = Counter(dict.fromkeys(WIRE_AUTH_REASONS, 0))
        self.socket_auth_failures_total = 0
        self.live_slots = 0
        self.staged_bytes = 0
        self.arenas: dict[str, int] = dict.fromkeys(ARENA_POOLS, 0)
        self.budget_bytes = 0
        self._ray: _RayExport | None = None
        if export_to_ray is None:
            export_to_ray = _inside_ray_worker()
        if export_to_ray:
            try:
                self._ray = _RayExport(node_id)
            except Exception:  # metrics must never stop an agent from serving
                _log.warning("ray_velo: Ray metrics export unavailable", exc_info=True)

    def path(self, path: str, reason: str) -> None:
        """Count one path decision (owner or consumer side, at docs/protocol.md §17's points)."""
        with self._lock:
            self.path_total[(path, reason)] += 1
        if self._ray is not None:
            self._ray["path"].inc(1, {"path": path, "reason": reason})

    def get_completed(self, seconds: float) -> None:
        """Count one completed RDMA GET that took ``seconds`` (without the acquire)."""
        with self._lock:
            self.get_duration_buckets[bisect.bisect_left(GET_BUCKETS_S, seconds)] += 1
            self.get_duration_count += 1
            self.get_duration_sum_s += seconds
        if self._ray is not None:
            self._ray["get_duration"].observe(seconds)

    def leases_reaped(self, count: int) -> None:
        """Count ``count`` RDMA leases the owner's reaper force-released."""
        if not count:
            return
        with self._lock:
            self.leases_reaped_total += count
        if self._ray is not None:
            self._ray["reaped"].inc(count)

    def device_staged(self, reason: str) -> None:
        """Count one CUDA tensor staged through host memory (``reason``: one of
        ``DEVICE_STAGING_REASONS``)."""
        with self._lock:
            self.device_staged_total[reason] += 1
        if self._ray is not None:
            self._ray["device_staged"].inc(1, {"reason": reason})

    def wire_auth_failed(self, reason: str) -> None:
        """Count one TCP wire peer that failed the handshake (``reason``: one of
        ``WIRE_AUTH_REASONS``)."""
        with self._lock:
            self.wire_auth_failures[reason] += 1
        if self._ray is not None:
            self._ray["wire_auth_failures"].inc(1, {"reason": reason})

    def socket_auth_failed(self) -> None:
        """Count one connection to the agent's Unix socket from another user."""
        with self._lock:
            self.socket_auth_failures_total += 1
        if self._ray is not None:
            self._ray["socket_auth_failures"].inc(1)

    def transparent_declined(self) -> None:
        """Count one transparent payload that no mapped arena could take (it travels inside
        the Ray call; the agent warms an arena up for the next one)."""
        with self._lock:
            self.transparent_inline_total += 1
        if self._ray is not None:
            self._ray["inline"].inc(1)

    def registration(self, kind: str, registered_bytes: int) -> None:
        """Count one registration (``kind`` arena or external); set the registered bytes."""
        with self._lock:
            self.registrations_total[kind] += 1
        self.set_registered(registered_bytes)
        if self._ray is not None:
            self._ray["registrations"].inc(1, {"kind": kind})

    def set_registered(self, registered_bytes: int, live_regions: int | None = None) -> None:
        """Set the registered-bytes gauge, and the live-regions gauge when given."""
        with self._lock:
            self.registered_bytes = registered_bytes
            if live_regions is not None:
                self.live_regions = live_regions
        if self._ray is not None:
            self._ray["registered"].set(registered_bytes)
            if live_regions is not None:
                self._ray["live_regions"].set(live_regions)

    def fetched(self, path: str, nbytes: int, seconds: float) -> None:
        """Count one fetch of ``nbytes`` bytes over ``path`` that took ``seconds``."""
        with self._lock:
            self.bytes_moved[path] += nbytes
            self.fetches[path] += 1
        if self._ray is not None:
            if nbytes > 0:  # Ray counters refuse a zero increment
                self._ray["bytes_moved"].inc(nbytes, {"path": path})
            self._ray["fetch_duration"].observe(seconds, {"path": path})

    def relayed(self) -> None:
        """Count one fetch whose bytes came (some or all) from a copy, not the owner."""
        with self._lock:
            self.relay_fetches_total += 1
        if self._ray is not None:
            self._ray["relayed"].inc(1)

    def set_slots(self, live_slots: int, staged_bytes: int) -> None:
        """Set the live-slots and staged-bytes gauges."""
        with self._lock:
            self.live_slots, self.staged_bytes = live_slots, staged_bytes
        if self._ray is not None:
            self._ray["live_slots"].set(live_slots)
            self._ray["staged_bytes"].set(staged_bytes)

    def refresh(self, gauges: Gauges) -> None:
        """Set every gauge (the agent's timer calls this every :data:`GAUGE_REFRESH_S`)."""
        with self._lock:
            self.registered_bytes, self.live_regions = gauges.registered_bytes, gauges.live_regions
            self.live_slots, self.staged_bytes = gauges.live_slots, gauges.staged_bytes
            self.arenas = {"registered": gauges.registered_arenas, "plain": gauges.plain_arenas}
            self.budget_bytes = gauges.budget_bytes
        if self._ray is not None:
            self._ray.set_gauges(gauges)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy of every counter (picklable; for tests and ``ray-velo status``)."""
        with self._lock:
            return {
                "velo_rendezvous_rdma_path_total": {
                    f"{path}/{reason}": n for (path, reason), n in sorted(self.path_total.items())
                },
                "velo_rendezvous_rdma_get_duration_seconds": {
                    "count": self.get_duration_count,
                    "sum": self.get_duration_sum_s,
                    # cumulative, keyed by the upper bound as Prometheus writes it ("+Inf" last)
                    "buckets": dict(
                        zip(
                            [*(repr(b) for b in GET_BUCKETS_S), "+Inf"],
                            itertools.accumulate(self.get_duration_buckets),
                            strict=True,
                        )
                    ),
                },
                "velo_rendezvous_rdma_leases_reaped_total": self.leases_reaped_total,
                "velo_transparent_inline_total": self.transparent_inline_total,
                "velo_rdma_registered_bytes": self.registered_bytes,
                "velo_rdma_registrations_total": dict(self.registrations_total),
                "velo_rdma_live_regions": self.live_regions,
                "velo_bytes_moved_total": dict(self.bytes_moved),
                "velo_fetches_total": dict(self.fetches),
                "velo_relay_fetches_total": self.relay_fetches_total,
                "velo_device_staged_total": dict(self.device_staged_total),
                "velo_wire_auth_failures_total": dict(self.wire_auth_failures),
                "velo_socket_auth_failures_total": self.socket_auth_failures_total,
                "velo_live_slots": self.live_slots,
                "velo_staged_bytes": self.staged_bytes,
                "velo_arenas": dict(self.arenas),
                "velo_rdma_budget_bytes": self.budget_bytes,
            }


def _inside_ray_worker() -> bool:
    try:
        import ray

        return bool(ray.is_initialized())
    except Exception:
        return False


def prometheus_registry(snapshots: dict[str, dict[str, Any]]) -> CollectorRegistry:
    """A ``prometheus_client`` registry holding the given agents' snapshots (by node id).

    Renders every protocol series (``velo_rendezvous_rdma_path_total{path, reason, node}``, the
    GET-duration histogram, reaped leases, registered bytes, registrations by kind, live
    regions) and the operator series, each labelled by ``node``. For a standalone scrape or
    a test; inside Ray the same series come from Ray's export.
    """
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(dict(snapshots)))
    return registry


#: Series an older agent's snapshot may lack: they render as 0 for it.
_NEWER_SERIES = frozenset(
    {"inline", "relayed", "device_staged", "wire_auth_failures", "socket_auth_failures"}
)


def _add_snapshot(families: dict[str, Any], node: str, snap: dict[str, Any]) -> None:
    """One agent's snapshot (:meth:`AgentMetrics.snapshot`, which keys a counter by its name
    and ``_total``, as a scrape shows it) as samples labelled ``node``."""
    for key, family in families.items():
        series = _SERIES[key]
        name = series.name + ("_total" if series.kind == "counter" else "")
        value = snap.get(name, {} if series.labels else 0) if key in _NEWER_SERIES else snap[name]
        if series.kind == "histogram":
            family.add_metric((node,), list(value["buckets"].items()), sum_value=value["sum"])
        elif series.labels:
            for labels, n in value.items():  # the path counter's key is "path/reason"
                family.add_metric((*labels.split("/", len(series.labels) - 1), node), n)
        else:
            family.add_metric((node,), value)


class _SnapshotCollector:
    """Serves fixed snapshots to a ``CollectorRegistry`` (it calls ``collect`` per scrape)."""

    def __init__(self, snapshots: dict[str, dict[str, Any]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        make = {
            "counter": CounterMetricFamily,
            "gauge": GaugeMetricFamily,
            "histogram": HistogramMetricFamily,
        }
        families = {
            key: make[series.kind](series.name, series.help, labels=(*series.labels, "node"))
            for key, series in _SERIES.items()
            if series.exported_by != "ray"
        }
        for node, snap in sorted(self._snapshots.items()):
            _add_snapshot(families, node, snap)
        yield from families.values()
