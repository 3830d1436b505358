"""Configuration: the spec's defaults, its clamps, and refusals that name field, value and rule."""

from __future__ import annotations

import math
import pickle
import warnings
from typing import Any

import pytest

from ray_velo import config
from ray_velo.config import (
    DEFAULT_THRESHOLD,
    RdmaConfig,
    RdmaPoolConfig,
    RdmaRendezvousConfig,
    UcxConfig,
    VeloConfig,
)
from ray_velo.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("actual", "spec"),
    [
        pytest.param(lambda: RdmaRendezvousConfig().rdma_min_bytes, 64 * KiB, id="rdma_min_bytes"),
        pytest.param(lambda: RdmaRendezvousConfig().enabled, True, id="enabled"),
        pytest.param(lambda: RdmaRendezvousConfig().lease_timeout, 30.0, id="lease_timeout"),
        pytest.param(lambda: RdmaPoolConfig().initial_arena_bytes, 64 * MiB, id="initial_arena"),
        pytest.param(lambda: RdmaPoolConfig().max_arena_bytes, 1 * GiB, id="max_arena_bytes"),
        pytest.param(lambda: RdmaPoolConfig().dedicated_arena_min, 64 * MiB, id="dedicated_min"),
        # None: each agent sizes it from its node (memory.node.default_budget), >= 1 GiB
        pytest.param(lambda: RdmaPoolConfig().registered_bytes_budget, None, id="budget"),
        pytest.param(lambda: RdmaPoolConfig().arena_reclaim_after, None, id="reclaim_after"),
        pytest.param(lambda: RdmaPoolConfig().retain_arena_bytes, 64 * MiB, id="retain_arena"),
        pytest.param(lambda: RdmaConfig().shutdown_timeout, 30.0, id="shutdown_timeout"),
        pytest.param(lambda: RdmaConfig().drop_dereg_timeout, 30.0, id="drop_dereg_timeout"),
        pytest.param(lambda: UcxConfig().eager_max, 1 * MiB, id="eager_max"),
        pytest.param(lambda: UcxConfig().ep_idle_timeout, None, id="ep_idle_timeout"),
        pytest.param(lambda: UcxConfig().eager_endpoints, False, id="eager_endpoints"),
        pytest.param(lambda: DEFAULT_THRESHOLD, 256 * KiB, id="DEFAULT_THRESHOLD"),
        pytest.param(lambda: VeloConfig().threshold_bytes, 256 * KiB, id="threshold_bytes"),
        pytest.param(lambda: VeloConfig().staged_fetch_timeout, None, id="staged_fetch_timeout"),
        pytest.param(lambda: VeloConfig().staged_payload_max, None, id="staged_payload_max"),
        pytest.param(lambda: config.SPEC_CHUNK_SIZE, 512 * KiB, id="spec_chunk_size"),
    ],
)
def test_default_is_the_spec_table(actual: Any, spec: Any) -> None:
    """Every knob of the spec's Configuration table defaults to the table's value."""
    value = actual()
    assert value == spec
    assert type(value) is type(spec)


def test_default_sizes_keep_the_spec_order() -> None:
    """rdma_min_bytes <= threshold: a transparently staged payload can take RDMA at once."""
    assert RdmaRendezvousConfig().rdma_min_bytes <= DEFAULT_THRESHOLD < config.SPEC_CHUNK_SIZE


def test_default_config_composes_the_rdma_parts() -> None:
    rdma = VeloConfig().rdma
    assert rdma.rendezvous == RdmaRendezvousConfig()
    assert rdma.pool == RdmaPoolConfig()
    assert rdma.ucx == UcxConfig()


def test_default_lease_timeout_goes_on_the_wire_as_30000_ms() -> None:
    assert RdmaRendezvousConfig().lease_timeout_ms == 30_000


@pytest.mark.parametrize("tiny", [1e-9, 1e-6, 0.0004999, 0.0009999])
def test_sub_millisecond_lease_timeout_clamps_to_one_ms(tiny: float) -> None:
    """On the wire 0 means "no deadline": a tiny lease_timeout must never round down to it."""
    rendezvous = RdmaRendezvousConfig(lease_timeout=tiny)
    assert rendezvous.lease_timeout == 0.001
    assert rendezvous.lease_timeout_ms == 1


@pytest.mark.parametrize(("seconds", "ms"), [(0.001, 1), (0.0014, 1), (0.25, 250), (30, 30_000)])
def test_lease_timeout_ms_is_whole_ms_never_zero(seconds: float, ms: int) -> None:
    assert RdmaRendezvousConfig(lease_timeout=seconds).lease_timeout_ms == ms


@pytest.mark.parametrize("short", [0.001, 0.1, 0.4999])
def test_ep_idle_timeout_below_500_ms_rises_to_500_ms(short: float) -> None:
    """The spec's floor: about 35 times the first GET's wireup on a fresh pair."""
    assert UcxConfig(ep_idle_timeout=short).ep_idle_timeout == 0.5


def test_ep_idle_timeout_at_or_above_the_floor_is_kept() -> None:
    assert UcxConfig(ep_idle_timeout=0.5).ep_idle_timeout == 0.5
    assert UcxConfig(ep_idle_timeout=2.0).ep_idle_timeout == 2.0


def test_rdma_min_bytes_above_the_threshold_warns() -> None:
    """A band of payloads would sit in pinned memory and never use the RDMA path."""
    with pytest.warns(UserWarning, match="rdma_min_bytes") as record:
        RdmaRendezvousConfig(rdma_min_bytes=DEFAULT_THRESHOLD + 1)
    # the warning points at the caller's line, not at config.py
    assert record[0].filename == __file__


def test_rdma_min_bytes_at_the_threshold_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RdmaRendezvousConfig(rdma_min_bytes=DEFAULT_THRESHOLD)


@pytest.mark.parametrize(
    ("build", "field_name", "value"),
    [
        (lambda: RdmaRendezvousConfig(rdma_min_bytes=-1), "rdma_min_bytes", -1),
        (lambda: RdmaRendezvousConfig(rdma_min_bytes=1.5), "rdma_min_bytes", 1.5),  # type: ignore[arg-type]
        (lambda: RdmaRendezvousConfig(lease_timeout=0), "lease_timeout", 0),
        (lambda: RdmaRendezvousConfig(lease_timeout=-3.0), "lease_timeout", -3.0),
        (lambda: RdmaRendezvousConfig(lease_timeout="30"), "lease_timeout", "30"),  # type: ignore[arg-type]
        (lambda: RdmaPoolConfig(initial_arena_bytes=0), "initial_arena_bytes", 0),
        (lambda: RdmaPoolConfig(max_arena_bytes=-1), "max_arena_bytes", -1),
        (lambda: RdmaPoolConfig(dedicated_arena_min=True), "dedicated_arena_min", True),
        (lambda: RdmaPoolConfig(registered_bytes_budget=1.0), "registered_bytes_budget", 1.0),  # type: ignore[arg-type]
        (lambda: RdmaPoolConfig(retain_arena_bytes=-4096), "retain_arena_bytes", -4096),
        (lambda: RdmaPoolConfig(arena_reclaim_after=0), "arena_reclaim_after", 0),
        (
            lambda: RdmaPoolConfig(initial_arena_bytes=2 * GiB, max_arena_bytes=1 * GiB),
            "max_arena_bytes",
            1 * GiB,
        ),
        (lambda: UcxConfig(eager_max=0), "eager_max", 0),
        (lambda: UcxConfig(ep_idle_timeout=-1.0), "ep_idle_timeout", -1.0),
        (lambda: RdmaConfig(shutdown_timeout=0), "shutdown_timeout", 0),
        (lambda: RdmaConfig(drop_dereg_timeout=-1), "drop_dereg_timeout", -1),
        (lambda: VeloConfig(threshold_bytes=0), "threshold_bytes", 0),
        (lambda: VeloConfig(chunk_size=4097), "chunk_size", 4097),
        (lambda: VeloConfig(pulls_in_flight=0), "pulls_in_flight", 0),
        (lambda: VeloConfig(staged_fetch_timeout=0.0), "staged_fetch_timeout", 0.0),
        (lambda: VeloConfig(staged_payload_max=0), "staged_payload_max", 0),
        (lambda: VeloConfig(shm_dir=""), "shm_dir", ""),
        (lambda: VeloConfig(plain_arena_bytes=-1), "plain_arena_bytes", -1),
    ],
)
def test_bad_value_raises_config_error_naming_field_value_and_rule(
    build: Any, field_name: str, value: Any
) -> None:
    """A typo in a config is refused at construction, with the field, value and rule."""
    with pytest.raises(ConfigError) as info:
        build()
    error = info.value
    assert isinstance(error, ValueError)
    assert error.fields["field"] == field_name
    assert error.fields["value"] == value
    assert error.fields["rule"]
    text = str(error)
    assert field_name in text
    assert repr(value) in text
    assert error.fields["rule"] in text


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    ("build", "field_name"),
    [
        (lambda v: RdmaRendezvousConfig(lease_timeout=v), "lease_timeout"),
        (lambda v: RdmaPoolConfig(arena_reclaim_after=v), "arena_reclaim_after"),
        (lambda v: UcxConfig(ep_idle_timeout=v), "ep_idle_timeout"),
        (lambda v: RdmaConfig(shutdown_timeout=v), "shutdown_timeout"),
        (lambda v: VeloConfig(staged_fetch_timeout=v), "staged_fetch_timeout"),
    ],
)
def test_non_finite_durations_are_refused(build: Any, field_name: str, bad: float) -> None:
    """NaN passes every ``<`` test and inf has no ms value: both used to slip through.

    A NaN lease_timeout made ``lease_timeout_ms`` raise ValueError on the owner's first
    RDMA acquire; inf raised OverflowError. None already says "unbounded".
    """
    with pytest.raises(ConfigError, match=field_name):
        build(bad)


def test_lease_timeout_that_would_overflow_the_wire_is_refused() -> None:
    """lease_timeout_ms is a u64 on the wire; a value past it would fail at encode time."""
    assert RdmaRendezvousConfig(lease_timeout=1e15).lease_timeout_ms < 1 << 64
    with pytest.raises(ConfigError, match="lease_timeout"):
        RdmaRendezvousConfig(lease_timeout=1e17)


def test_configs_are_frozen() -> None:
    rendezvous = RdmaRendezvousConfig()
    with pytest.raises(AttributeError):
        rendezvous.lease_timeout = 1.0  # type: ignore[misc]


def test_replace_validates_again() -> None:
    base = VeloConfig()
    assert base.replace(chunk_size=4096).chunk_size == 4096
    with pytest.raises(ConfigError, match="chunk_size"):
        base.replace(chunk_size=100)


def test_ucx_options_given_as_a_dict_become_a_sorted_tuple() -> None:
    """A dict would make the frozen config unhashable; it is normalised at construction."""
    ucx = UcxConfig(options={"TLS": "cma,tcp", "NET_DEVICES": "mlx5_0:1"})  # type: ignore[arg-type]
    assert ucx.options == (("NET_DEVICES", "mlx5_0:1"), ("TLS", "cma,tcp"))
    hash(ucx)


def test_configs_pickle_for_ray_actors() -> None:
    """Configs travel to the agent actors: they pickle, compare equal, and keep their clamps."""
    velo = VeloConfig(
        staged_fetch_timeout=12.5,
        staged_payload_max=8 * GiB,
        rdma=RdmaConfig(
            rendezvous=RdmaRendezvousConfig(rdma_min_bytes=0, enabled=False, lease_timeout=1e-6),
            pool=RdmaPoolConfig(arena_reclaim_after=5.0, retain_arena_bytes=0),
            ucx=UcxConfig(ep_idle_timeout=0.1, eager_endpoints=True, options=(("TLS", "tcp"),)),
            shutdown_timeout=3.0,
        ),
    )
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(velo, protocol=protocol))
        assert copy == velo
        assert copy.rdma.rendezvous.lease_timeout_ms == 1
        assert copy.rdma.ucx.ep_idle_timeout == 0.5


def test_unpickling_does_not_warn_again() -> None:
    """The above-threshold warning fires where the config is built, not in every actor."""
    with pytest.warns(UserWarning):
        rendezvous = RdmaRendezvousConfig(rdma_min_bytes=DEFAULT_THRESHOLD * 2)
    data = pickle.dumps(rendezvous)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pickle.loads(data) == rendezvous


@pytest.mark.parametrize(
    ("memory", "shm", "budget"),
    [
        pytest.param(24 * GiB, 24 * GiB, 6 * GiB, id="a quarter of the memory"),
        pytest.param(256 * GiB, 16 * GiB, 8 * GiB, id="at most half the shm directory"),
        pytest.param(2 * GiB, 64 * MiB, 1 * GiB, id="at least the spec's 1 GiB"),
    ],
)
def test_the_default_budget_follows_the_node(memory: int, shm: int, budget: int) -> None:
    from ray_velo.agent.node_memory import default_budget

    assert default_budget(memory, shm) == budget


def test_an_agent_without_a_budget_set_takes_its_nodes(tmp_path: Any) -> None:
    from ray_velo import metrics
    from ray_velo.agent.node_memory import SPEC_BUDGET_BYTES, NodeMemory

    memory = NodeMemory(VeloConfig(shm_dir=str(tmp_path)), 1, None, metrics.AgentMetrics("n"))
    assert memory.budget.budget_bytes >= SPEC_BUDGET_BYTES
    set_one = VeloConfig(
        shm_dir=str(tmp_path), rdma=RdmaConfig(pool=RdmaPoolConfig(registered_bytes_budget=MiB))
    )
    assert NodeMemory(set_one, 1, None, metrics.AgentMetrics("n")).budget.budget_bytes == MiB
