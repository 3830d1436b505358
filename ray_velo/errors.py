"""The one exception tree of ray_velo: structured fields, messages built from them, and pickling
(docs/architecture.md §9)."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AgentDied",
    "AgentShuttingDown",
    "BudgetExceeded",
    "ConfigError",
    "DescriptorError",
    "HandleError",
    "HandleNotFound",
    "HandleReleased",
    "LeaseNotFound",
    "MemoryError_",
    "NotInitialized",
    "OwnerDied",
    "OwnerUnreachable",
    "PayloadTooLarge",
    "PoolExhausted",
    "ProtocolError",
    "RayFeatureUnavailable",
    "RegionDeregistered",
    "RegionError",
    "SharedMemoryTooSmall",
    "StagingError",
    "TransferError",
    "TransferTimeout",
    "UcxError",
    "UnsupportedPayload",
    "VeloError",
    "WireAuthError",
    "WireReadError",
]


def _rebuild(cls: type[VeloError], message: str | None, fields: dict[str, Any]) -> VeloError:
    return cls(message, **fields)


class _Fields(dict[str, Any]):
    def __missing__(self, name: str) -> None:  # a field not given reads None
        return None


class VeloError(Exception):
    """Root of every ray_velo error.

    Subclasses declare their structured fields as keyword arguments and build the message
    from them: a ``_template`` (``str.format`` names the fields) or, where that is not enough,
    an override of :meth:`_describe`. An explicit ``message`` wins.
    """

    _template: ClassVar[str | None] = None

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)
        self.message = message if message is not None else self._describe()
        super().__init__(self.message)

    def _describe(self) -> str:
        if self._template is not None:
            return self._template.format_map(_Fields(self.fields))
        return ", ".join(f"{k}={v!r}" for k, v in self.fields.items()) or type(self).__name__

    def __reduce__(self) -> tuple[Any, ...]:
        explicit = self.message if self.message != self._describe() else None
        return (_rebuild, (type(self), explicit, self.fields))

    def __str__(self) -> str:  # comes before KeyError's (no quotes) in the subclasses' MRO
        return self.message


# --- caused by the caller -------------------------------------------------------------


class ConfigError(VeloError, ValueError):
    """A configuration value breaks a rule. Fields: ``field``, ``value``, ``rule``."""

    _template = "invalid config {field}={value!r}: {rule}"


class UnsupportedPayload(VeloError, TypeError):
    """``put`` got an object it cannot stage. Fields: ``type_name``."""

    _template = (
        "cannot stage a {type_name}: pass a numpy array, a bytes-like object (bytes, bytearray, "
        "memoryview) or a torch tensor on the CPU or a CUDA device"
    )


class RayFeatureUnavailable(VeloError, RuntimeError):
    """A ray_velo feature needs something this Ray does not have. Fields: ``feature``,
    ``needs`` (the Ray version or API it needs), ``found`` (this Ray's version)."""

    _template = (
        "{feature} needs {needs}; this is Ray {found}. Upgrade Ray for it; everything else of "
        "ray_velo works on this Ray"
    )


class NotInitialized(VeloError, RuntimeError):
    """The library was used before ``ray_velo.init()`` or after ``shutdown()``."""

    _template = "ray_velo is not initialized: call ray_velo.init() first"


# --- handles and leases -----------------------------------------------------------------


class HandleError(VeloError):
    """Something is wrong with a handle."""


class HandleNotFound(HandleError, KeyError):
    """The owner has no slot for this handle (never existed, released, or expired).

    Fields: ``handle``, ``node`` (the owner's node, when known), ``reason`` (why it is
    gone, when the owner remembers).
    """

    def _describe(self) -> str:
        node = self.fields.get("node")
        where = f" on owner node {node}" if node else ""
        reason = self.fields.get("reason")
        why = (
            f": {reason}"
            if reason
            else ": it was released, its TTL expired, or its owner restarted"
        )
        return f"handle {self.fields.get('handle')} not found{where}{why}; stage the data again"

    @property
    def released(self) -> bool:
        """Whether its consumers released it: it was used as often as it allowed."""
        return self.fields.get("reason") == RELEASED_BY_CONSUMERS


#: The ``reason`` of a HandleNotFound whose last reference was released.
RELEASED_BY_CONSUMERS = "released by its last consumer"


class HandleReleased(HandleError):
    """A single-use (or N-use) handle was resolved more times than allowed.

    Fields: ``handle``, ``allowed``, ``option`` (what to change).
    """

    def _describe(self) -> str:
        f = self.fields
        return (
            f"handle {f.get('handle')} was already resolved {f.get('allowed')} time(s), all it "
            f"allows; for more consumers use {f.get('option', 'consumers=N')}"
        )


class LeaseNotFound(HandleError, KeyError):
    """A lease id is unknown to the owner (already released, reaped, or never granted).

    Fields: ``handle``, ``lease_id``.
    """

    _template = (
        "lease {lease_id} on handle {handle} is not held: it was released, or reaped after its "
        "deadline passed without renewal"
    )


# --- memory -----------------------------------------------------------------------------


class MemoryError_(VeloError):  # the trailing underscore: do not shadow the builtin
    """Staging memory could not be provided."""


class SharedMemoryTooSmall(MemoryError_, OSError):
    """The shared-memory directory cannot hold a new arena.

    Fields: ``directory``, ``free_bytes``, ``requested_bytes``.
    """

    _template = (
        "shared-memory directory {directory} has {free_bytes} bytes free, {requested_bytes} "
        "requested: enlarge it (e.g. docker --shm-size) or set VeloConfig(shm_dir=...) to a "
        "larger tmpfs"
    )


class BudgetExceeded(MemoryError_):
    """Registering would exceed ``registered_bytes_budget``.

    Fields: ``requested_bytes``, ``registered_bytes``, ``budget_bytes``.
    """

    _template = (
        "registering {requested_bytes} bytes would exceed registered_bytes_budget "
        "({registered_bytes} of {budget_bytes} bytes already registered)"
    )


class PoolExhausted(MemoryError_):
    """The arena pool cannot allocate. Fields: ``requested_bytes``, ``reason``."""

    _template = "arena pool cannot allocate {requested_bytes} bytes: {reason}"


class RegionError(VeloError):
    """A caller-owned registered region cannot be used."""


class RegionDeregistered(RegionError):
    """The region is deregistering or deregistered. Fields: ``region``."""

    _template = "region {region} is deregistered; register the memory again"


class StagingError(VeloError):
    """Staging a payload failed (not a memory shortage). Fields vary."""


class AgentShuttingDown(StagingError):
    """The node's agent is shutting down (``rv.shutdown``, ``ray-velo stop``): it takes no
    new staging, fetch or GET. A subclass of StagingError, which it was before it had a name
    of its own. Fields: ``node``."""

    _template = (
        "the ray_velo agent on node {node} is shutting down: it takes nothing new; call "
        "ray_velo.init() again once it is gone for a fresh one"
    )


# --- caused by the world or the peer ---------------------------------------------------


class ProtocolError(VeloError):
    """A peer broke the protocol (e.g. answered RDMA to an acquire that made no offer)."""


class DescriptorError(ProtocolError, ValueError):
    """An RDMA descriptor or packed key does not decode byte for byte. Fields: ``reason``."""

    _template = "RDMA descriptor refused: {reason}"


class WireAuthError(ProtocolError):
    """A peer on the agents' TCP wire failed the handshake that proves it holds the
    cluster's secret (or, under Ray's TLS, a certificate of the cluster's CA). Fields:
    ``reason`` (one of ``ray_velo.protocol.handshake.WIRE_AUTH_REASONS``), ``peer``."""

    def _describe(self) -> str:
        f = self.fields
        peer = f" with {f['peer']}" if f.get("peer") else ""
        return (
            f"the ray_velo wire handshake{peer} failed ({f.get('reason')}): only agents of "
            "this Ray cluster (they read its secret from Ray's KV) are served. If both ends are "
            "agents of one cluster, check that they run the same ray_velo version and, with "
            "RAY_USE_TLS=1, certificates signed by the same CA"
        )


class TransferError(VeloError):
    """A transfer failed."""


class TransferTimeout(TransferError, TimeoutError):
    """A fetch did not finish within its bound.

    Fields: ``handle``, ``timeout_s`` (the bound), ``bound`` (which one: caller or receiver).
    """

    def _describe(self) -> str:
        f = self.fields
        return (
            f"fetch of handle {f.get('handle')} did not finish within {f.get('timeout_s')} s "
            f"({f.get('bound', 'fetch timeout')}); raise the timeout or check the owner node"
        )


class OwnerDied(TransferError):
    """The owner agent (or its node) is gone. Fields: ``handle``, ``node``."""

    _template = (
        "owner of handle {handle} on node {node} died or left the cluster; its staged data is "
        "lost, stage it again"
    )


class OwnerUnreachable(TransferError):
    """Ray reports the owner's agent unavailable (stalled, or being restarted), not dead.
    Fields: ``handle``, ``node``."""

    _template = (
        "owner of handle {handle} on node {node} does not answer (Ray reports it unavailable, "
        "not dead): it may be stalled or restarting; retry later or bound the fetch with timeout="
    )


class PayloadTooLarge(TransferError):
    """A staged payload is larger than this node takes (``staged_payload_max``).

    Fields: ``handle``, ``size_bytes``, ``limit_bytes``.
    """

    _template = (
        "payload of handle {handle} is {size_bytes} bytes, over this node's staged_payload_max "
        "of {limit_bytes} bytes; the staged copy was released. Raise "
        "VeloConfig.staged_payload_max or send less"
    )


class AgentDied(VeloError):
    """This node's own agent died during a call. The next call starts a fresh agent; the
    payloads the dead one staged are lost."""

    _template = (
        "this node's ray_velo agent died during the call; the next call starts a new one "
        "(payloads it had staged are lost, stage them again)"
    )


class WireReadError(TransferError):
    """A bulk read over the agents' wire failed: the connection broke, stalled past its
    bound, or the sender stopped before the end of the range (its lease ended). Nothing read
    is used. Fields: ``handle``, ``peer``, ``start``, ``stop``, ``got`` (bytes that had
    arrived), ``reason``."""

    _template = (
        "reading bytes [{start}, {stop}) of handle {handle} from {peer} over the agents' wire "
        "failed after {got} bytes: {reason}"
    )


class UcxError(TransferError):
    """A UCX call failed. Fields: ``operation``, ``status`` (ucs_status_t), ``status_text``."""

    _template = "UCX {operation} failed: {status_text} (status {status})"
