"""Hardware this CI machine lacks: InfiniBand/RoCE. Each test runs for real where the
hardware is present and skips loudly, naming what is missing, where it is not. CUDA GPUs
have their own folder: tests/gpu."""

from __future__ import annotations

import os

import pytest

from .test_ucx_rma import MiB, _no_exception, run_pair

IB_DEVICES = "/sys/class/infiniband"


def _infiniband_devices() -> list[str]:
    try:
        return sorted(os.listdir(IB_DEVICES))
    except FileNotFoundError:
        return []


@pytest.mark.ucx
def test_get_over_infiniband_verbs() -> None:
    """On an InfiniBand/RoCE host with a system UCX built with verbs: a checksum-verified
    64 MiB GET between two processes over rc (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)."""
    devices = _infiniband_devices()
    if not devices:
        pytest.skip(f"SKIPPED (hardware): no InfiniBand/RoCE device under {IB_DEVICES}")
    env = {"UCX_TLS": "rc,sm,self", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true"}
    result, owner_rc, consumer_rc = run_pair(env, "numpy", 64 * MiB, "get", "numpy")
    _no_exception(result)
    assert result["crc_ok"], result
    assert (owner_rc, consumer_rc) == (0, 0)
