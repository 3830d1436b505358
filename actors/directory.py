"""Node directory: create, find and route to the rendezvous agent of each Ray node."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_velo import _ray
from ray_velo.actors.agent import RendezvousAgent
from ray_velo.actors.faults import FaultPlan
from ray_velo.actors.jobs import RayJobTable
from ray_velo.agent import nonblocking
from ray_velo.config import VeloConfig
from ray_velo.errors import AgentShuttingDown, ConfigError
from ray_velo.local.channel import (
    DISABLE_ENV,
    ChannelServer,
    remove_stale_sockets,
    socket_path,
)
from ray_velo.protocol import entry as entries
from ray_velo.protocol.entry import BY_NAME, Entry
from ray_velo.protocol.handshake import SECRET_BYTES
from ray_velo.state.fetch import Mode
from ray_velo.state.relays import RELAY_DISABLE_ENV
from ray_velo.wire.auth import WireAuth
from ray_velo.wire.server import WIRE_DISABLE_ENV, WireServer

__all__ = [
    "NAMESPACE",
    "RendezvousActor",
    "agent_name",
    "alive_node_ids",
    "bulk_address_of",
    "cluster_config_stored",
    "ensure_agent",
    "ensure_agents",
    "find_agent",
    "load_cluster_config",
    "node_of_worker",
    "register_all_peers",
    "store_cluster_config",
    "wire_address_of",
    "wire_secret",
]

NAMESPACE = "ray_velo"
_KV_NAMESPACE = "ray_velo"
_log = logging.getLogger(__name__)
_CONFIG_KEY = b"config"
_WIRE_SECRET_KEY = b"wire_secret"
#: Threads an agent runs its blocking work on (the handlers, mappings, GETs, copies). A
#: fetch waiting for an owner's answer holds none of them: it is a coroutine.
AGENT_THREADS = 64
#: Calls one agent has in progress at once (coroutines: fetches waiting on owners included).
AGENT_MAX_CONCURRENCY = 4096


def agent_name(node_id: str) -> str:
    """The well-known actor name of ``node_id``'s agent."""
    return f"ray_velo_agent_{node_id}"


def _served(entry: Entry) -> Any:
    """The actor's method for ``entry``, which the plain agent serves: its declaration
    (:mod:`ray_velo.protocol.entry`) says which method of the plain agent, with which
    arguments, and whether on the event loop or a thread."""

    async def serve(self: _RendezvousActor, *args: Any) -> Any:
        return await self.run(entry, *args)

    serve.__name__ = serve.__qualname__ = entry.name
    return serve


class _RendezvousActor:
    """The agent as an asyncio Ray actor.

    Each entry point of :mod:`ray_velo.protocol.entry` is a method (:func:`_served`, or a
    coroutine of its own). The quick ones (``runs="loop"``: a short change of state) run the
    plain agent's method on the event loop, and again on a thread only if they reach a step
    that may block (:mod:`ray_velo.agent.nonblocking`): a thread hop saved each way on the
    transfer's path. The others run on one of :data:`AGENT_THREADS` threads; ``fetch_remote``
    is a coroutine whose waits on the owner hold no thread, so fetches hanging on a stalled
    owner never starve the others (nor the owner handlers this agent serves). It records its
    worker id for routing.
    """

    def __init__(self, config: VeloConfig, node_id: str) -> None:
        # The blocking calls run on our own threads, never on the event loop.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self._wire_auth = _load_wire_auth(self._wire_refused)
        wire_on = self._wire_auth is not None and os.environ.get(WIRE_DISABLE_ENV) != "1"
        host = ray.util.get_node_ip_address() if wire_on else None  # type: ignore[no-untyped-call]
        self.agent = RendezvousAgent(
            config,
            node_id,
            jobs=RayJobTable(),
            wire_auth=self._wire_auth,
            bulk_host=host,
            faults=FaultPlan() if config.fault_injection else None,
        )
        self.worker_id = self.agent.worker_id
        self._threads = ThreadPoolExecutor(AGENT_THREADS, thread_name_prefix="ray_velo-call")
        self._threads_closed = False
        _ray.kv_put(
            _worker_key(self.worker_id), node_id.encode(), overwrite=True, namespace=_KV_NAMESPACE
        )
        self._channel: ChannelServer | None = None
        if os.environ.get(DISABLE_ENV) != "1":
            remove_stale_sockets(config.shm_dir)
            path = socket_path(config.shm_dir, os.getpid(), self.worker_id)
            metrics = self.agent.core.metrics
            self._channel = ChannelServer(path, self._channel_call, metrics.socket_auth_failed)
        self._wire: WireServer | None = None
        if self._wire_auth is not None and host is not None:
            self._wire = WireServer(host, self._wire_call, self._wire_auth)
        bulk = self.agent.bulk
        if bulk is not None:  # other nodes' agents read payload bytes there
            _ray.kv_put(
                _bulk_key(self.worker_id),
                bulk.address.encode(),
                overwrite=True,
                namespace=_KV_NAMESPACE,
            )
        self._started: asyncio.Future[None] | None = None

    async def _serving(self) -> str:
        """Start the socket and the TCP wire on the event loop, once (Ray runs ``__init__``
        off it); the socket's path, or "" when there is none (Ray calls instead)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_servers())
        await asyncio.shield(self._started)
        return "" if self._channel is None else self._channel.path

    async def _start_servers(self) -> None:
        if self._channel is not None:
            try:
                await self._channel.start()
            except OSError:
                _log.warning("ray_velo: the agent's socket failed; Ray calls", exc_info=True)
                self._channel = None
        if self._wire is not None:
            try:
                await self._wire.start()
            except OSError:
                _log.warning("ray_velo: the agent's TCP wire failed; Ray calls", exc_info=True)
                self._wire = None
                return
            _ray.kv_put(
                _wire_key(self.worker_id),
                self._wire.address.encode(),
                overwrite=True,
                namespace=_KV_NAMESPACE,
            )
            # Other nodes' agents reach our copies over the wire: we may keep and serve them.
            self.agent.core.serves_copies = os.environ.get(RELAY_DISABLE_ENV) != "1"

    def _wire_refused(self, reason: str) -> None:
        self.agent.core.metrics.wire_auth_failed(reason)

    # --- the entry points the plain agent serves ------------------------------------

    stage_reserve = _served(entries.STAGE_RESERVE)
    stage_commit = _served(entries.STAGE_COMMIT)
    stage_abort = _served(entries.STAGE_ABORT)
    stage_written = _served(entries.STAGE_WRITTEN)
    local_acquire = _served(entries.LOCAL_ACQUIRE)
    end_lease = _served(entries.END_LEASE)
    claim_end = _served(entries.CLAIM_END)
    release_quietly = _served(entries.RELEASE_QUIETLY)
    _rv_metadata = _served(entries.RV_METADATA)
    _rv_acquire = _served(entries.RV_ACQUIRE)
    _rv_ref = _served(entries.RV_REF)
    _rv_detach = _served(entries.RV_DETACH)
    _rv_release = _served(entries.RV_RELEASE)
    _rv_lease_renew = _served(entries.RV_LEASE_RENEW)
    _rv_pull = _served(entries.RV_PULL)
    _rv_window = _served(entries.RV_WINDOW)
    _rv_copy = _served(entries.RV_COPY)
    _rv_relay = _served(entries.RV_RELAY)
    _rv_relay_end = _served(entries.RV_RELAY_END)
    region_alloc = _served(entries.REGION_ALLOC)
    region_stage = _served(entries.REGION_STAGE)
    region_unregister = _served(entries.REGION_UNREGISTER)
    region_deregistered = _served(entries.REGION_DEREGISTERED)
    route = _served(entries.ROUTE)
    ucx_address = _served(entries.UCX_ADDRESS)
    register_peers = _served(entries.REGISTER_PEERS)
    cleanup = _served(entries.CLEANUP)
    status = _served(entries.STATUS)
    inject_fault = _served(entries.INJECT_FAULT)

    async def run(self, entry: Entry, *args: Any) -> Any:
        """Run ``entry`` on the plain agent: on the event loop when it may, else a thread."""
        method = self.agent.serve(entry)
        if entry.runs == "loop":
            return await self.quick(method, *args)
        return await self.blocking(method, *args)

    async def _wire_call(self, method: str, message: bytes) -> Any:
        return await self.run(BY_NAME[method], message)  # the server decoded a wire method

    async def _channel_call(self, method: str, args: tuple[Any, ...]) -> Any:
        entry = BY_NAME[method]  # the socket carries only its entries
        if entry.runs == "coroutine":
            return await getattr(self, method)(*args)
        return await self.run(entry, *args)

    async def info(self) -> dict[str, Any]:
        """The agent's identity and counters, and the path of its socket ("": none)."""
        socket = await self._serving()
        info: dict[str, Any] = await self.blocking(self.agent.info)
        info["socket"] = socket
        info["socket_calls"] = 0 if self._channel is None else self._channel.calls
        info["wire"] = "" if self._wire is None else self._wire.address
        info["wire_calls"] = 0 if self._wire is None else self._wire.calls
        info["wire_peers"] = 0 if self._wire is None else self._wire.peers
        info["wire_tls"] = self._wire_auth is not None and self._wire_auth.tls is not None
        bulk, reader = self.agent.bulk, self.agent.bulk_reader
        info["bulk"] = "" if bulk is None else bulk.address
        info["bulk_reads_served"] = 0 if bulk is None else bulk.reads
        info["bulk_bytes_sent"] = 0 if bulk is None else bulk.bytes_sent
        info["bulk_sends_stopped"] = 0 if bulk is None else bulk.aborted
        info["bulk_reads"] = 0 if reader is None else reader.reads
        return info

    async def blocking(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the agent's threads (AgentShuttingDown after its shutdown)."""
        if self._threads_closed:
            raise self._closed_error()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args))

    async def quick(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` right here on the event loop; on the agent's threads instead if
        it reaches a step that may block (it raised WouldBlock before changing anything)."""
        try:
            with nonblocking.on_loop(self._offload):
                return fn(*args)
        except nonblocking.WouldBlock:
            return await self.blocking(fn, *args)

    def _offload(self, work: Any) -> None:
        # A quick call's slow effect (unmapping): on a thread, not waited for; here once
        # the threads are gone (after shutdown no transfer is left to keep waiting).
        try:
            self._threads.submit(_logged, work)
        except RuntimeError:
            _logged(work)

    async def ping(self) -> int:
        await self._serving()
        return self.worker_id

    async def fetch_remote(
        self,
        handle: Any,
        mode: Mode,
        timeout_s: float | None,
        pid: int,
        bound: str,
        into_reservation: int = 0,
    ) -> Any:
        """The consumer's fetch (see ``ConsumerService.fetch_async``)."""
        return await self.agent.consumer.fetch_async(
            handle,
            mode,
            timeout_s,
            pid,
            bound,
            self.blocking,
            into_reservation,
        )

    async def fetch_into_writer(
        self,
        handle: Any,
        timeout_s: float | None,
        pid: int,
        bound: str,
        nbytes: int,
        mode: Mode = "detach",
    ) -> Any:
        """A PinnedWriter with the bytes fetched into it (``fetch_into_writer_async``)."""
        return await self.agent.fetch_into_writer_async(
            handle, timeout_s, pid, bound, nbytes, self.blocking, self.quick, mode
        )

    async def shutdown(self, timeout_s: float | None = None) -> dict[str, int]:
        """The agent's shutdown, then its threads (the call itself runs on one)."""
        freed: dict[str, int] = await self.blocking(self.agent.shutdown, timeout_s)
        channel, self._channel = self._channel, None  # after the drain: its calls answered
        if channel is not None:
            await channel.close(self._closed_error())
        wire, self._wire = self._wire, None
        if wire is not None:
            _ray.kv_delete(_wire_key(self.worker_id), namespace=_KV_NAMESPACE)
            await wire.close()
        if self.agent.bulk is not None:  # closed by the agent's shutdown, in its order
            _ray.kv_delete(_bulk_key(self.worker_id), namespace=_KV_NAMESPACE)
        self._threads.shutdown(wait=False)
        self._threads_closed = True
        return freed

    def _closed_error(self) -> BaseException:
        """What a call to this agent after its shutdown gets."""
        return AgentShuttingDown(node=self.agent.node_id)


def _logged(work: Any) -> None:
    try:
        work()
    except Exception:  # nobody waits for it: say so here
        _log.exception("ray_velo: a deferred free failed")


RendezvousActor: Any = ray.remote(num_cpus=0, max_concurrency=AGENT_MAX_CONCURRENCY)(  # type: ignore[call-overload]
    _RendezvousActor
)


def _load_wire_auth(on_refusal: Any) -> WireAuth | None:
    """This agent's credentials for the agents' TCP wire (Ray's TLS files where Ray uses
    TLS); None, logged, when they do not load: the agent then serves and calls no wire."""
    try:
        return WireAuth.from_environment(wire_secret(), os.environ, on_refusal)
    except ConfigError as exc:
        _log.warning("ray_velo: no TCP wire on this agent (%s); Ray calls instead", exc)
        return None


def wire_secret() -> bytes:
    """The cluster's wire secret: created once by the first agent that asks, in Ray's KV,
    which only processes Ray admitted can read (Ray's token guards it)."""
    _ray.kv_put(
        _WIRE_SECRET_KEY,
        secrets.token_bytes(SECRET_BYTES),
        overwrite=False,
        namespace=_KV_NAMESPACE,
    )
    value = _ray.kv_get(_WIRE_SECRET_KEY, namespace=_KV_NAMESPACE)
    if not isinstance(value, bytes) or len(value) != SECRET_BYTES:
        raise ConfigError(
            field="wire secret", value=None, rule="must be in Ray's KV (ray_velo namespace)"
        )
    return value


def _worker_key(worker_id: int) -> bytes:
    return f"worker:{worker_id:016x}".encode()


def _wire_key(worker_id: int) -> bytes:
    return f"wire:{worker_id:016x}".encode()


def _bulk_key(worker_id: int) -> bytes:
    return f"bulk:{worker_id:016x}".encode()


def bulk_address_of(worker_id: int) -> str | None:
    """``host:port`` where the agent that issued ``worker_id``'s handles sends payload bytes
    to other nodes' agents (its bulk port), or None (it sends none: an older version, or
    the wire off)."""
    value = _ray.kv_get(_bulk_key(worker_id), namespace=_KV_NAMESPACE)
    return value.decode() if value else None


def wire_address_of(worker_id: int) -> str | None:
    """``host:port`` where the agent that issued ``worker_id``'s handles serves its short
    handlers over TCP, or None (it serves them as Ray calls only)."""
    value = _ray.kv_get(_wire_key(worker_id), namespace=_KV_NAMESPACE)
    return value.decode() if value else None


def node_of_worker(worker_id: int) -> str | None:
    """The node whose agent issued handles with ``worker_id``, if known."""
    value = _ray.kv_get(_worker_key(worker_id), namespace=_KV_NAMESPACE)
    return value.decode() if value else None


def store_cluster_config(config: VeloConfig) -> None:
    """Publish the config so agents created later (new nodes) use the same one."""
    _ray.kv_put(_CONFIG_KEY, pickle.dumps(config), overwrite=True, namespace=_KV_NAMESPACE)


def cluster_config_stored() -> bool:
    """Whether some driver published a config (``rv.init``) in this cluster."""
    return bool(_ray.kv_exists(_CONFIG_KEY, namespace=_KV_NAMESPACE))


def load_cluster_config() -> VeloConfig:
    value = _ray.kv_get(_CONFIG_KEY, namespace=_KV_NAMESPACE)
    if not value:
        return VeloConfig()
    config = pickle.loads(value)
    assert isinstance(config, VeloConfig)
    return config


def alive_node_ids() -> list[str]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n["NodeID"] for n in nodes if n.get("Alive")]


def ensure_agent(
    node_id: str, config: VeloConfig | None = None, env: dict[str, str] | None = None
) -> Any:
    """The agent of ``node_id``, created there if it does not exist yet (race-free).

    ``env``: environment variables of a newly created agent (over its node's), e.g. the
    kill switch for one agent; an existing agent keeps its own.
    """
    if config is None:
        config = load_cluster_config()
    extra: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
    return RendezvousActor.options(
        name=agent_name(node_id),
        namespace=NAMESPACE,
        get_if_exists=True,
        # Detached: an agent must not share the fate of whichever process created it (a task
        # worker Ray may recycle), nor die when that process drops its handle. shutdown()
        # (or `ray-velo stop`) ends it; with the embedded local cluster, Ray's exit does.
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **extra,
    ).remote(config, node_id)


def ensure_agents(
    config: VeloConfig, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """An agent on every alive node, each answering a ping. Returns them by node id."""
    agents = {node_id: ensure_agent(node_id, config, env) for node_id in alive_node_ids()}
    ray.get([agent.ping.remote() for agent in agents.values()], timeout=timeout_s)
    register_all_peers(agents, timeout_s)
    return agents


def register_all_peers(agents: dict[str, Any] | None = None, timeout_s: float = 120.0) -> None:
    """Tell every agent every other agent's UCX worker address, so the first fetch between
    two nodes can already offer RDMA (otherwise each pair's first transfer is chunked)."""
    if agents is None:
        agents = {node_id: find_agent(node_id) for node_id in alive_node_ids()}
    addresses = dict(
        zip(
            agents,
            ray.get([a.ucx_address.remote() for a in agents.values()], timeout=timeout_s),
            strict=False,
        )
    )
    ray.get([a.register_peers.remote(addresses) for a in agents.values()], timeout=timeout_s)


def find_agent(node_id: str) -> Any:
    """The existing agent of ``node_id``. Raises ValueError if there is none."""
    return ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
