"""CUDA memory through this library's UCX binding, in a fresh spawned process (UCX must not
be forked after it starts, and the test process may run Ray): ucp_mem_map of device memory
says CUDA in its packed key, a GPU arena pool opens on the real allocator and registrar, and
a loopback GET moves device bytes into device memory (cuda_ipc / cuda_copy)."""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.connection import Connection
from typing import Any

import pytest

from tests.gpu.conftest import require_cuda

require_cuda(
    "ucp_mem_map of CUDA memory (packed key says cuda), a GPU arena pool on "
    "TorchCudaAllocator + UcxRegistrar(CUDA), a loopback GET device to device"
)

pytestmark = [pytest.mark.gpu, pytest.mark.ucx]

MiB = 1 << 20


def _register_and_get(results: Connection, nbytes: int) -> None:
    try:
        results.send(_checks(nbytes))
    except BaseException as exc:
        results.send({"exception": repr(exc), "traceback": traceback.format_exc()})


def _checks(nbytes: int) -> dict[str, Any]:
    import torch

    from ray_velo.memory.device import DeviceArenaPool, DevicePlacement, TorchCudaAllocator
    from ray_velo.memory.pool import RegistrationBudget
    from ray_velo.protocol.memtype import SUPPORTED_MEMORY_TYPES, MemoryType
    from ray_velo.ucx import Endpoint, MemoryRegistration, RemoteKey, UcxContext, UcxWorker, get
    from ray_velo.ucx.backend import UcxRegistrar
    from ray_velo.ucx.rkey import parse_packed_rkey

    out: dict[str, Any] = {}
    ctx = UcxContext()
    try:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dest = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        reg = MemoryRegistration.from_address(
            ctx, src.data_ptr(), nbytes, keepalive=src, memory_type=MemoryType.CUDA
        )
        dest_reg = MemoryRegistration.from_address(
            ctx, dest.data_ptr(), nbytes, keepalive=dest, memory_type=MemoryType.CUDA
        )
        out["key_mem_type"] = int(parse_packed_rkey(reg.packed_rkey).mem_type)
        worker = UcxWorker(ctx)
        ep = Endpoint(worker, worker.address)
        rkey = RemoteKey(ep, reg.packed_rkey, SUPPORTED_MEMORY_TYPES)
        get(ep, dest.data_ptr(), nbytes, src.data_ptr(), rkey, 30.0, local_memh=dest_reg)
        torch.cuda.synchronize()
        out["get_ok"] = bool(torch.equal(src, dest))

        pool = DeviceArenaPool(
            0,
            TorchCudaAllocator(),
            UcxRegistrar(ctx, MemoryType.CUDA),
            RegistrationBudget(1 << 30),
            64 * MiB,
        )
        out["pool_open"] = pool.open()
        placement = pool.allocate(nbytes)
        out["placed"] = isinstance(placement, DevicePlacement)
        if isinstance(placement, DevicePlacement):
            pool.view(placement).copy_(src)
            out["view_ok"] = bool(torch.equal(pool.view(placement), src))
            pool.free(placement)
        pool.close()
        out["budget_after_close"] = pool.budget.registered_bytes
    finally:
        ctx.close()
    return out


def test_cuda_memory_registers_and_moves_device_to_device() -> None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_register_and_get, args=(theirs, 16 * MiB))
    child.start()
    try:
        assert ours.poll(120), "the UCX/CUDA child did not answer within 120 s"
        result = ours.recv()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert "exception" not in result, result.get("traceback")
    assert result == {
        "key_mem_type": 1,  # UCS_MEMORY_TYPE_CUDA
        "get_ok": True,
        "pool_open": None,
        "placed": True,
        "view_ok": True,
        "budget_after_close": 0,
    }
