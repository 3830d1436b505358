"""The exception tree: every error pickles (Ray moves them between processes), subclasses the
builtin a caller would catch, and says what went wrong and what to do."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from ray_velo import errors
from ray_velo.errors import (
    BudgetExceeded,
    ConfigError,
    HandleNotFound,
    LeaseNotFound,
    PayloadTooLarge,
    SharedMemoryTooSmall,
    TransferTimeout,
    VeloError,
)

#: Realistic fields for each public class; a new class must add its own here.
FIELDS: dict[str, dict[str, Any]] = {
    "AgentDied": {},
    "AgentShuttingDown": {"node": "node-a"},
    "BudgetExceeded": {
        "requested_bytes": 1 << 30,
        "registered_bytes": 512 << 20,
        "budget_bytes": 1 << 30,
    },
    "ConfigError": {"field": "lease_timeout", "value": -1.0, "rule": "must be > 0 seconds"},
    "DescriptorError": {"reason": "3 trailing bytes after the key"},
    "HandleError": {"handle": "00000000deadbeef:7"},
    "HandleNotFound": {
        "handle": "00000000deadbeef:7",
        "node": "node-a",
        "reason": "its TTL expired",
    },
    "HandleReleased": {"handle": "00000000deadbeef:7", "allowed": 1, "option": "consumers=N"},
    "LeaseNotFound": {"handle": "00000000deadbeef:7", "lease_id": 42},
    "MemoryError_": {"requested_bytes": 4096},
    "NotInitialized": {},
    "OwnerDied": {"handle": "00000000deadbeef:7", "node": "node-b"},
    "OwnerUnreachable": {"handle": "00000000deadbeef:7", "node": "node-b"},
    "PayloadTooLarge": {
        "handle": "00000000deadbeef:7",
        "size_bytes": 3 << 30,
        "limit_bytes": 1 << 30,
    },
    "PoolExhausted": {"requested_bytes": 1 << 20, "reason": "no room and may not map"},
    "ProtocolError": {"reason": "owner answered RDMA to an acquire with no offer"},
    "RegionDeregistered": {"region": 3},
    "RegionError": {"region": 3},
    "SharedMemoryTooSmall": {
        "directory": "/dev/shm",
        "free_bytes": 64 << 20,
        "requested_bytes": 256 << 20,
    },
    "StagingError": {"reason": "zero-length payload"},
    "RayFeatureUnavailable": {
        "feature": "the VELO tensor transport",
        "needs": "Ray >= 2.55.0",
        "found": "2.40.0",
    },
    "WireAuthError": {"reason": "bad_proof", "peer": "10.0.0.7:41234"},
    "WireReadError": {
        "handle": "00000000deadbeef:7",
        "peer": "10.0.0.7:41235",
        "start": 0,
        "stop": 4194304,
        "got": 65536,
        "reason": "the bytes stopped coming (the sender closed the connection)",
    },
    "TransferError": {"handle": "00000000deadbeef:7"},
    "TransferTimeout": {"handle": "00000000deadbeef:7", "timeout_s": 2.5, "bound": "caller"},
    "UcxError": {"operation": "ucp_get_nbx", "status": -3, "status_text": "Input/output error"},
    "UnsupportedPayload": {"type_name": "dict"},
    "VeloError": {"detail": "anything"},
}


def error_class(name: str) -> type[VeloError]:
    cls = getattr(errors, name)
    assert isinstance(cls, type) and issubclass(cls, VeloError)
    return cls


def round_trip(exc: BaseException) -> Any:
    return pickle.loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))


def test_every_public_error_has_a_scenario_here() -> None:
    """A class added to errors.__all__ without fields here would escape the pickle test."""
    assert set(errors.__all__) == set(FIELDS)


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_error_round_trips_through_pickle_with_fields_and_message(name: str) -> None:
    """Ray pickles an exception raised in the owner's agent and raises it in the caller."""
    cls = error_class(name)
    original = cls(**FIELDS[name])
    copy = round_trip(original)
    assert type(copy) is cls
    assert copy.fields == original.fields
    for field_name, value in FIELDS[name].items():
        assert getattr(copy, field_name) == value
    assert copy.message == original.message
    assert str(copy) == str(original)
    assert copy.args == original.args
    assert isinstance(copy, VeloError)


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_explicit_message_survives_pickle(name: str) -> None:
    """A message written at the raise site (not built from fields) is not rebuilt on arrival."""
    cls = error_class(name)
    original = cls("the owner said no", **FIELDS[name])
    copy = round_trip(original)
    assert str(copy) == "the owner said no"
    assert copy.fields == original.fields


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_error_without_fields_still_has_a_message(name: str) -> None:
    """Code that raises a bare class still produces a readable, picklable error."""
    cls = error_class(name)
    exc = cls()
    assert str(exc)
    assert str(round_trip(exc)) == str(exc)


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (TransferTimeout, TimeoutError),
        (HandleNotFound, KeyError),
        (LeaseNotFound, KeyError),
        (ConfigError, ValueError),
        (errors.DescriptorError, ValueError),
        (errors.UnsupportedPayload, TypeError),
        (errors.NotInitialized, RuntimeError),
        (SharedMemoryTooSmall, OSError),
    ],
)
def test_errors_are_the_builtin_a_caller_would_catch(
    cls: type[VeloError], builtin: type[BaseException]
) -> None:
    """``except TimeoutError`` / ``except KeyError`` keep working, after a pickle too."""
    exc = cls(**FIELDS[cls.__name__])
    assert isinstance(exc, builtin)
    assert isinstance(round_trip(exc), builtin)
    with pytest.raises(builtin):
        raise exc


def test_taxonomy() -> None:
    """The tree groups errors by who caused them, so callers can catch a whole branch."""
    assert issubclass(errors.ProtocolError, VeloError)
    assert issubclass(errors.DescriptorError, errors.ProtocolError)
    assert issubclass(TransferTimeout, errors.TransferError)
    assert issubclass(errors.OwnerDied, errors.TransferError)
    assert issubclass(PayloadTooLarge, errors.TransferError)
    assert issubclass(errors.UcxError, errors.TransferError)
    assert issubclass(HandleNotFound, errors.HandleError)
    assert issubclass(LeaseNotFound, errors.HandleError)
    assert issubclass(errors.HandleReleased, errors.HandleError)
    for cls in (BudgetExceeded, errors.PoolExhausted, SharedMemoryTooSmall):
        assert issubclass(cls, errors.MemoryError_)
    assert not issubclass(errors.MemoryError_, MemoryError)  # must not shadow the builtin
    assert issubclass(errors.RegionDeregistered, errors.RegionError)


def test_handle_not_found_str_is_the_message_not_a_quoted_key() -> None:
    """KeyError's str() quotes its argument; a log line must read as a sentence."""
    exc = HandleNotFound(**FIELDS["HandleNotFound"])
    text = str(exc)
    assert not text.startswith(("'", '"'))
    assert text == exc.message
    assert "00000000deadbeef:7" in text
    assert "node-a" in text
    assert "its TTL expired" in text
    assert "stage the data again" in text  # what to do
    assert str(round_trip(exc)) == text


def test_handle_not_found_without_a_known_reason_lists_the_likely_ones() -> None:
    text = str(HandleNotFound(handle="00000000deadbeef:7"))
    assert "released" in text and "TTL" in text and "restarted" in text
    assert "on owner node" not in text  # no node known: not "on owner node None"


def test_lease_not_found_str_is_the_message() -> None:
    exc = LeaseNotFound(**FIELDS["LeaseNotFound"])
    assert str(exc) == exc.message
    assert "lease 42" in str(exc) and "00000000deadbeef:7" in str(exc)
    assert "reaped" in str(exc)


def test_payload_too_large_names_both_sizes_and_the_knob() -> None:
    """The spec: a refusal over staged_payload_max names both sizes."""
    text = str(PayloadTooLarge(**FIELDS["PayloadTooLarge"]))
    assert str(3 << 30) in text
    assert str(1 << 30) in text
    assert "staged_payload_max" in text
    assert "00000000deadbeef:7" in text


def test_shared_memory_too_small_names_directory_free_and_requested() -> None:
    """A container with a 64 MiB /dev/shm: the message says where, how much, and the fix."""
    text = str(SharedMemoryTooSmall(**FIELDS["SharedMemoryTooSmall"]))
    assert "/dev/shm" in text
    assert str(64 << 20) in text
    assert str(256 << 20) in text
    assert "shm-size" in text or "shm_dir" in text


def test_budget_exceeded_names_request_usage_and_budget() -> None:
    text = str(BudgetExceeded(**FIELDS["BudgetExceeded"]))
    assert "registered_bytes_budget" in text
    assert str(1 << 30) in text and str(512 << 20) in text


def test_config_error_names_field_value_and_rule() -> None:
    text = str(ConfigError(**FIELDS["ConfigError"]))
    assert "lease_timeout" in text and "-1.0" in text and "must be > 0 seconds" in text


def test_transfer_timeout_names_handle_bound_and_what_to_do() -> None:
    text = str(TransferTimeout(**FIELDS["TransferTimeout"]))
    assert "00000000deadbeef:7" in text and "2.5 s" in text and "caller" in text
    assert "raise the timeout" in text


def test_ucx_error_names_operation_and_status() -> None:
    text = str(errors.UcxError(**FIELDS["UcxError"]))
    assert "ucp_get_nbx" in text and "-3" in text and "Input/output error" in text


def test_a_failed_wire_read_names_the_range_the_peer_and_what_arrived() -> None:
    text = str(errors.WireReadError(**FIELDS["WireReadError"]))
    assert "[0, 4194304)" in text and "00000000deadbeef:7" in text and "10.0.0.7:41235" in text
    assert "after 65536 bytes" in text and "stopped coming" in text


def test_cause_is_not_needed_to_read_the_error() -> None:
    """Foreign errors are mapped with ``raise ... from exc``; the mapped one stands alone."""
    try:
        try:
            raise ConnectionResetError("peer gone")
        except ConnectionResetError as exc:
            raise errors.OwnerDied(handle="h", node="node-b") from exc
    except errors.OwnerDied as mapped:
        assert isinstance(mapped.__cause__, ConnectionResetError)
        copy = round_trip(mapped)
        assert "node-b" in str(copy) and "stage it again" in str(copy)
