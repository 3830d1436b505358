"""Which UCX transports an agent may use: never ``tcp`` unless an operator opted in
(ray_velo.ucx.policy; docs/deployment.md §8)."""

from __future__ import annotations

import pytest

from ray_velo.config import UcxConfig
from ray_velo.ucx.backend import agent_transports
from ray_velo.ucx.policy import UCX_TCP_ENV, choose_transports, ucx_tcp_allowed


@pytest.mark.parametrize(
    ("requested", "tls"),
    [
        (None, "^tcp"),
        ("all", "^tcp"),
        ("", "^tcp"),
        ("^cma", "^cma,tcp"),
        ("^tcp", "^tcp"),
        ("^tcp,cma", "^tcp,cma"),
        ("cma,sm,self", "cma,sm,self"),
        ("rc,sm,self", "rc,sm,self"),
        ("cma,tcp", "cma"),
        ("tcp,rc,self", "rc,self"),
        ("TCP,cma", "cma"),
    ],
)
def test_an_agent_without_the_opt_in_leaves_tcp_out(requested: str | None, tls: str) -> None:
    """Whatever the operator's UCX_TLS, the context an agent builds names no tcp: UCX's
    default (every transport) becomes all-but-tcp, an exclusion list gains it, an explicit
    list loses it and says why."""
    choice = choose_transports(requested, tcp_allowed=False)
    assert choice.start and choice.tls == tls
    assert choice.tls.startswith("^") or "tcp" not in choice.tls.split(",")
    named_tcp = requested is not None and "tcp" in requested.lower().split(",")
    assert bool(choice.note) == (named_tcp and not requested.startswith("^"))  # type: ignore[union-attr]


def test_a_request_for_tcp_alone_starts_no_ucx_and_says_why() -> None:
    choice = choose_transports("tcp", tcp_allowed=False)
    assert not choice.start
    assert UCX_TCP_ENV in choice.note and "no UCX" in choice.note


@pytest.mark.parametrize("requested", [None, "all", "tcp", "cma,tcp", "^cma"])
def test_with_the_opt_in_the_request_stands(requested: str | None) -> None:
    choice = choose_transports(requested, tcp_allowed=True)
    assert choice.start and choice.tls == requested and not choice.note


@pytest.mark.parametrize(
    ("configured", "env", "allowed"),
    [
        (False, {}, False),
        (False, {UCX_TCP_ENV: "1"}, True),
        (False, {UCX_TCP_ENV: " On "}, True),
        (False, {UCX_TCP_ENV: "0"}, False),
        (False, {UCX_TCP_ENV: "tru"}, False),
        (True, {}, True),
    ],
)
def test_the_opt_in_is_the_config_field_or_the_variable(
    configured: bool, env: dict[str, str], allowed: bool
) -> None:
    assert ucx_tcp_allowed(configured, env) is allowed


def test_the_option_wins_over_the_environment() -> None:
    """``UcxConfig.options["TLS"]`` is what the context would have used (it wins over
    UCX_TLS), so it is what the policy narrows."""
    config = UcxConfig(options={"TLS": "cma,tcp"})  # type: ignore[arg-type]
    tcp, choice = agent_transports(config, {"UCX_TLS": "rc"})
    assert (tcp, choice.tls) == (False, "cma")
    tcp, choice = agent_transports(UcxConfig(), {"UCX_TLS": "tcp", UCX_TCP_ENV: "yes"})
    assert (tcp, choice.tls) == (True, "tcp")
    tcp, choice = agent_transports(UcxConfig(tcp=True), {})
    assert (tcp, choice.tls, choice.start) == (True, None, True)
