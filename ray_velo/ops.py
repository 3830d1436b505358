"""What an operator runs against a cluster: each agent's status, and the cleanup of segments dead
processes left (``ray-velo status`` / ``ray-velo cleanup``, docs/deployment.md §9)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ray_velo.memory.arena import remove_stale_segments

__all__ = [
    "NodeCleanup",
    "cleanup_cluster",
    "cleanup_local",
    "cluster_status",
    "dashboard_dir",
    "default_shm_dir",
    "install_dashboard",
]

#: The file name the dashboard is installed under (Ray's own are ``*_grafana_dashboard.json``).
DASHBOARD_FILE = "ray_velo_grafana_dashboard.json"
#: Where Ray's Grafana provisioning reads dashboards, below a session directory.
_SESSION_DASHBOARDS = os.path.join("metrics", "grafana", "dashboards")

#: How long a status or cleanup call waits for one node (s).
NODE_TIMEOUT_S = 30.0


@dataclass
class NodeCleanup:
    """What cleanup removed on one node (``via``: ``agent``, ``task`` or ``local``)."""

    node_id: str
    via: str
    removed: list[tuple[str, int]] = field(default_factory=list)
    error: str = ""


def _remove_on_node(shm_dir: str) -> list[tuple[str, int]]:
    return [(s.path, s.nbytes) for s in remove_stale_segments(shm_dir)]


def cleanup_local(shm_dir: str) -> NodeCleanup:
    """Remove the dead processes' segments in ``shm_dir`` on this machine."""
    return NodeCleanup(node_id="this machine", via="local", removed=_remove_on_node(shm_dir))


def cleanup_cluster(shm_dir: str) -> list[NodeCleanup]:
    """On every alive node: its agent removes the dead processes' segments, or, where no
    agent runs (it was killed), a zero-CPU task pinned to the node does, without starting
    one. Needs a connected Ray driver."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_velo.actors import alive_node_ids, find_agent

    remover = ray.remote(num_cpus=0)(_remove_on_node)
    calls: dict[str, tuple[str, Any]] = {}
    for node_id in alive_node_ids():
        try:
            agent = find_agent(node_id)  # held: Ray 2.40's method keeps only a weak reference
            calls[node_id] = ("agent", agent.cleanup.remote())
        except ValueError:
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            calls[node_id] = (
                "task",
                remover.options(scheduling_strategy=strategy).remote(shm_dir),
            )
    out = []
    for node_id, (via, ref) in calls.items():
        try:
            removed = [(str(p), int(n)) for p, n in ray.get(ref, timeout=NODE_TIMEOUT_S)]
            out.append(NodeCleanup(node_id, via, removed))
        except Exception as exc:  # one sick node must not hide the others' results
            out.append(NodeCleanup(node_id, via, error=f"{type(exc).__name__}: {exc}"))
    return out


def cluster_status() -> list[dict[str, Any]]:
    """One status object per alive node (``node_id`` and ``error`` where no agent answers)."""
    import ray

    from ray_velo.actors import alive_node_ids, find_agent

    calls: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    for node_id in alive_node_ids():
        try:
            agent = find_agent(node_id)  # held: Ray 2.40's method keeps only a weak reference
            calls[node_id] = agent.status.remote()
        except ValueError:
            out.append({"node_id": node_id, "error": "no ray_velo agent on this node"})
    for node_id, ref in calls.items():
        try:
            out.append(dict(ray.get(ref, timeout=NODE_TIMEOUT_S)))
        except Exception as exc:
            out.append({"node_id": node_id, "error": f"agent not answering: {type(exc).__name__}"})
    return sorted(out, key=lambda s: str(s["node_id"]))


def runtime_report() -> dict[str, Any]:
    """What this process runs ray_velo with, and what each allows (``ray-velo doctor``, the
    first line of ``ray-velo status``): Ray (and its auth and TLS settings), UCX, torch."""
    import sys

    import ray

    import ray_velo
    from ray_velo import _ray
    from ray_velo.ucx.loader import ucx_available

    ucx_ok, ucx_text = ucx_available()
    try:
        import torch

        torch_version: str | None = str(torch.__version__)
    except ImportError:
        torch_version = None
    transports = _ray.has_tensor_transport()
    rdt_needs = f"needs Ray >= {_ray.version_text(_ray.RDT_MIN_VERSION)}"
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    return {
        "ray_velo": ray_velo.__version__,
        "python": sys.version.split()[0],
        "ray": ray.__version__,
        "ray_checked": list(_ray.CHECKED_VERSIONS),
        "auth": _ray.auth_mode(),
        "tls": tls,
        "ucx": ucx_text if ucx_ok else f"unavailable: {ucx_text}",
        "torch": torch_version,
        "features": {
            "put/fetch": "yes",
            "rdma": "yes" if ucx_ok else "no: chunked path only (no usable UCX)",
            "@transfer": "yes",
            "VELO_NUMPY transport": "yes" if transports else f"no: {rdt_needs}",
            "VELO transport (torch)": (
                f"no: {rdt_needs}"
                if not transports
                else "yes"
                if torch_version
                else "no: needs torch"
            ),
            "wire under TLS": (
                ("yes" if sys.version_info >= (3, 11) else "no: needs Python 3.11")
                if tls
                else "n/a (Ray runs without TLS)"
            ),
        },
    }


def format_runtime(report: dict[str, Any]) -> str:
    """:func:`runtime_report` as two lines."""
    head = (
        f"ray_velo {report['ray_velo']} on Ray {report['ray']} (auth {report['auth']}, TLS "
        f"{'on' if report['tls'] else 'off'}), {report['ucx']}, torch {report['torch'] or 'none'}"
        f", Python {report['python']}"
    )
    features = ", ".join(f"{name}: {allowed}" for name, allowed in report["features"].items())
    return f"{head}\n  features: {features}"


def default_shm_dir() -> str:
    """The cluster's configured shm directory when a driver is connected, else /dev/shm."""
    try:
        import ray

        if ray.is_initialized():
            from ray_velo.actors.directory import load_cluster_config

            return load_cluster_config().shm_dir
    except Exception:  # no cluster config to read: the default directory
        pass
    from ray_velo.config import VeloConfig

    return VeloConfig().shm_dir


def dashboard_dir(session_dir: str | None = None) -> str:
    """Where Ray's Grafana provisioning reads dashboards: ``RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR``
    when set (Ray writes its own there too), else the session's ``metrics/grafana/dashboards``
    (``session_dir``, default ``/tmp/ray/session_latest``)."""
    configured = os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR")
    if configured:
        return configured
    return os.path.join(session_dir or "/tmp/ray/session_latest", _SESSION_DASHBOARDS)


def install_dashboard(directory: str) -> str:
    """Copy ray_velo's Grafana dashboard into ``directory`` (made if missing). Returns the
    path written."""
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, DASHBOARD_FILE)
    source = resources.files("ray_velo").joinpath("grafana_dashboard.json")
    with resources.as_file(source) as path:
        shutil.copyfile(path, target)
    return target
