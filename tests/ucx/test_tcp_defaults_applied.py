"""The tuned tcp segment sizes reach a real UCX context, and who wins over them.

The binding cannot read a setting back, so a TX segment size of ``1`` byte serves as the
probe: UCX (1.22, as tested) refuses to open a tcp interface with it (``AM Zcopy context must be <= TX
segment size``), so ``ucp_worker_create`` fails exactly when that value is the one in force.
Each case runs in a spawned child (this process never loads UCX) with ``UCX_TLS=tcp``; the
pure decision is tested in tests/unit/test_ucx_tcp_defaults.py.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import pytest

pytestmark = pytest.mark.ucx

SPAWN = multiprocessing.get_context("spawn")
RESULT_TIMEOUT_S = 45.0
TOO_SMALL = "1"  # bytes: no tcp interface opens with it


def _context_and_worker(results: Connection, env: dict[str, str], options: dict[str, str]) -> None:
    """Child body: a context with ``options`` under ``env`` (and no other ``UCX_*``), then a
    worker and an endpoint to itself; reports what UCX accepted."""
    out: dict[str, Any] = {}
    try:
        for name in [n for n in os.environ if n.startswith("UCX_")]:
            del os.environ[name]
        os.environ.update(env)
        from ray_velo.errors import UcxError
        from ray_velo.ucx import ucx_available
        from ray_velo.ucx.binding import Endpoint, UcxContext, UcxWorker

        out["available"] = ucx_available()
        if out["available"][0]:
            context = UcxContext(options)
            out["options"] = dict(context.options)
            try:
                worker = UcxWorker(context)
                endpoint = Endpoint(worker, worker.address)
                out["transports"] = sorted({tl for tl, _ in endpoint.transports()})
                out["worker"] = "ok"
            except UcxError as exc:
                out["worker"] = exc.fields["operation"]
            finally:
                context.close()
    except BaseException as exc:
        out["exception"] = repr(exc)
        out["traceback"] = traceback.format_exc()
    results.send(out)


def run_case(env: dict[str, str], options: dict[str, str]) -> dict[str, Any]:
    results_r, results_w = SPAWN.Pipe(duplex=False)
    child = SPAWN.Process(target=_context_and_worker, args=(results_w, env, options), daemon=True)
    child.start()
    results_w.close()
    try:
        if not results_r.poll(RESULT_TIMEOUT_S):
            pytest.fail(f"no result from the UCX child within {RESULT_TIMEOUT_S} s")
        result: dict[str, Any] = results_r.recv()
    except EOFError:
        pytest.fail("the UCX child died without a result")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)
    assert child.exitcode == 0
    assert "exception" not in result, result.get("traceback")
    if not result["available"][0]:
        pytest.skip(f"UCX unavailable: {result['available'][1]}")
    return result


TCP = {"UCX_TLS": "tcp"}


def test_with_nothing_set_ucx_takes_the_tuned_sizes_and_tcp_opens() -> None:
    """The default agent: UCX knows both option names (a misspelt one is refused by
    ucp_config_modify), takes 128k for both, and a tcp worker and endpoint come up."""
    result = run_case(TCP, {})
    assert (result["options"]["TCP_TX_SEG_SIZE"], result["options"]["TCP_RX_SEG_SIZE"]) == (
        "128k",
        "128k",
    )
    assert result["worker"] == "ok" and result["transports"] == ["tcp"]


def test_the_probe_value_breaks_tcp_when_it_is_in_force() -> None:
    """Calibration: a 1-byte TX segment given as an option makes the worker fail, so a
    worker that comes up proves that value was not in force (and it beat the tuned 128k)."""
    assert run_case(TCP, {"TCP_TX_SEG_SIZE": TOO_SMALL})["worker"] == "ucp_worker_create"


def test_an_environment_setting_is_not_overridden_by_the_tuned_default() -> None:
    """UCX_TCP_TX_SEG_SIZE exported: that value is the one UCX uses (the 1-byte probe breaks
    the worker), not the tuned 128k."""
    result = run_case({**TCP, "UCX_TCP_TX_SEG_SIZE": TOO_SMALL}, {})
    assert "TCP_TX_SEG_SIZE" not in result["options"]
    assert result["worker"] == "ucp_worker_create"


def test_a_config_option_wins_over_the_environment() -> None:
    """UcxConfig(options=...) names a size the environment also sets: the config's is in
    force, whichever of the two is the probe."""
    env_probe = run_case({**TCP, "UCX_TCP_TX_SEG_SIZE": TOO_SMALL}, {"TCP_TX_SEG_SIZE": "64k"})
    assert env_probe["worker"] == "ok"
    config_probe = run_case({**TCP, "UCX_TCP_TX_SEG_SIZE": "64k"}, {"TCP_TX_SEG_SIZE": TOO_SMALL})
    assert config_probe["worker"] == "ucp_worker_create"
