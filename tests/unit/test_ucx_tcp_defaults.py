"""The tuned tcp segment sizes (``TUNED_DEFAULTS``) and who wins over them.

The decision is :func:`ray_velo.ucx.binding._normalize_options`, a pure function of the
caller's options and ``os.environ``: what it returns is exactly what ``UcxContext`` applies
with ``ucp_config_modify`` after ``ucp_config_read`` read the ``UCX_*`` environment (the
binding has no way to read a setting back). Importing the binding loads no UCX, so nothing
here touches UCX; tests/ucx/test_tcp_defaults_applied.py checks that a real context takes them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from ray_velo.config import UcxConfig
from ray_velo.ucx import backend
from ray_velo.ucx.binding import TUNED_DEFAULTS, _normalize_options

TX, RX = "TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"


@pytest.fixture(autouse=True)
def no_ucx_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every scenario from a process environment with no ``UCX_*`` setting."""
    for name in [n for n in os.environ if n.startswith("UCX_")]:
        monkeypatch.delenv(name)


def test_the_tuned_segment_sizes_are_128_kib() -> None:
    """The values docs/tuning.md measured (UCX's own 8 KiB caps a GET near 1 GB/s)."""
    assert TUNED_DEFAULTS == {TX: "128k", RX: "128k"}


def test_with_nothing_set_both_tuned_sizes_are_applied() -> None:
    """A user who configured nothing gets the tuned tcp segments, beside the settings the
    library always applies."""
    assert _normalize_options({}) == {
        "RCACHE_ENABLE": "n",
        TX: "128k",
        RX: "128k",
        "RNDV_THRESH": "inf",
    }


def test_an_environment_setting_is_left_to_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user exported UCX_TCP_TX_SEG_SIZE: ucp_config_read already took it, and nothing is
    applied over it; the receive size, which they did not set, is still tuned."""
    monkeypatch.setenv(f"UCX_{TX}", "64k")
    options = _normalize_options({})
    assert TX not in options
    assert options[RX] == "128k"


def test_both_environment_settings_leave_no_tuned_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both sizes exported (say, the user's own sweep): neither tuned value is applied."""
    monkeypatch.setenv(f"UCX_{TX}", "64k")
    monkeypatch.setenv(f"UCX_{RX}", "32k")
    options = _normalize_options({})
    assert TX not in options and RX not in options


def test_an_unrelated_ucx_variable_keeps_the_tuned_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX_TLS=tcp (the usual way to pick tcp) is no reason to drop the segment tuning."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    options = _normalize_options({})
    assert (options[TX], options[RX]) == ("128k", "128k")


@pytest.mark.parametrize("key", [TX, f"UCX_{TX}", TX.lower()])
def test_a_ucx_config_option_wins_over_the_tuned_default(key: str) -> None:
    """VeloConfig(rdma.ucx=UcxConfig(options=...)) names a segment size, with or without the
    UCX_ prefix, in any case: that value is applied, not the tuned one."""
    config = UcxConfig(options={key: "256k"})
    options = _normalize_options(dict(config.options))
    assert options[TX] == "256k"
    assert options[RX] == "128k"


def test_a_ucx_config_option_wins_over_the_environment_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both set: the config's value is applied with ucp_config_modify, after the environment
    was read, so the config wins (the documented order)."""
    monkeypatch.setenv(f"UCX_{TX}", "64k")
    options = _normalize_options(dict(UcxConfig(options={TX: "512k"}).options))
    assert options[TX] == "512k"


def test_the_decision_reads_the_environment_at_each_context_not_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent started after the user exported the variable sees it (no cached snapshot)."""
    assert TX in _normalize_options({})
    monkeypatch.setenv(f"UCX_{TX}", "64k")
    assert TX not in _normalize_options({})


class _Stop(Exception):
    pass


def test_the_agents_backend_hands_the_config_options_to_its_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent builds its UCX backend from VeloConfig.rdma.ucx (TCP allowed here): the
    options reaching the context are the config's, so its segment size is what the context
    applies. (The context and worker are stand-ins: no UCX is loaded.)"""

    class RecordingContext:
        def __init__(self, options: dict[str, str]) -> None:
            self.options = _normalize_options(options)
            self.closed = False
            built.append(self)

        def close(self) -> None:
            self.closed = True

    built: list[RecordingContext] = []

    def no_worker(*args: Any, **kwargs: Any) -> None:
        raise _Stop

    monkeypatch.setattr(backend, "UcxContext", RecordingContext)
    monkeypatch.setattr(backend, "UcxWorker", no_worker)
    with pytest.raises(_Stop):
        backend.UcxRdmaBackend(
            UcxConfig(options={TX: "256k", "TLS": "tcp"}, tcp=True),
            time.monotonic,
        )
    [context] = built
    assert (context.options[TX], context.options[RX]) == ("256k", "128k")
    assert context.options["TLS"] == "tcp"
    assert context.closed  # the failed backend closed the context it made
