"""CUDA tensors through rv.put / rv.fetch and the "VELO" tensor transport, on a real
two-node Ray cluster sharing one GPU.

What is built today: a CUDA tensor is staged through host memory (no GPU arena is wired
into the agent yet), counted in velo_device_staged{reason=no_gpu_arena}, and rebuilt on the
consumer's current CUDA device. The two tests marked ``xfail(strict=True)`` state the
issue's goal (the payload stays on the GPU: a GET into the consumer's GPU arena across
nodes, CUDA IPC on one node): they fail today by design and XPASS, failing the run, the
day the agent wiring lands, so their marker must go with it.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from tests.gpu.conftest import counts, grown, require_cuda

torch = require_cuda(
    "put/fetch of CUDA tensors across nodes and on one node, the device rule, the VELO "
    "tensor transport with CUDA tensors"
)

import ray  # noqa: E402

import ray_velo as rv  # noqa: E402

rv.register_transports()  # before the classes below name "VELO"

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.multinode]

MiB = 1 << 20
ON_A = {"resources": {"node_a": 1}, "num_cpus": 0, "num_gpus": 0.25}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0, "num_gpus": 0.25}
NO_GPU_ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def crc(tensor: Any) -> int:
    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def cuda_payload(nbytes: int, seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


@ray.remote(**ON_A)
def put_on_a(nbytes: int, seed: int) -> tuple[rv.DataHandle, int]:
    tensor = cuda_payload(nbytes, seed)
    return rv.put(tensor), crc(tensor)


@ray.remote(**ON_B)
def fetch_on_b(handle: rv.DataHandle, device: str | None = None) -> tuple[str, int]:
    tensor = rv.fetch(handle, device=device)
    return str(tensor.device), crc(tensor)


@ray.remote(**ON_A)
def fetch_on_a(handle: rv.DataHandle) -> tuple[str, int]:
    tensor = rv.fetch(handle)
    return str(tensor.device), crc(tensor)


@ray.remote(**NO_GPU_ON_B)
def fetch_without_gpu(handle: rv.DataHandle) -> tuple[str, int]:
    # Ray hides the GPU from a task that asked for none (CUDA_VISIBLE_DEVICES="").
    tensor = rv.fetch(handle)
    return str(tensor.device), crc(tensor)


def test_cuda_tensor_crosses_nodes_and_lands_on_the_consumers_gpu(gpu_cluster: Any) -> None:
    """A 64 MiB CUDA tensor put on node a, fetched on node b: a CUDA tensor with the same
    bytes on b's current device; today through host memory, counted as such on the owner,
    the host bytes moved by one RDMA GET."""
    before = {node: counts(node) for node in ("node_a", "node_b")}
    handle, expected = ray.get(put_on_a.remote(64 * MiB, 1))
    device, got = ray.get(fetch_on_b.remote(handle))
    assert (device, got) == ("cuda:0", expected)
    assert grown(before["node_a"], counts("node_a")).get("device:no_gpu_arena") == 1
    assert grown(before["node_b"], counts("node_b")).get("path:rdma/ok") == 1


def test_the_caller_names_the_device(gpu_cluster: Any) -> None:
    handle, expected = ray.get(put_on_a.remote(MiB, 2))
    assert ray.get(fetch_on_b.remote(handle, "cpu")) == ("cpu", expected)


def test_a_consumer_without_a_gpu_gets_a_cpu_tensor(gpu_cluster: Any) -> None:
    handle, expected = ray.get(put_on_a.remote(MiB, 3))
    assert ray.get(fetch_without_gpu.remote(handle)) == ("cpu", expected)


@pytest.mark.xfail(
    strict=True, reason="GPU arenas are not wired into the agent yet (issue 16): host bounce"
)
def test_cross_node_cuda_tensor_stays_on_the_gpu(gpu_cluster: Any) -> None:
    """The goal: no device-to-host staging on the owner; one GET into b's GPU arena."""
    before = counts("node_a")
    handle, expected = ray.get(put_on_a.remote(64 * MiB, 4))
    assert ray.get(fetch_on_b.remote(handle)) == ("cuda:0", expected)
    assert "device:no_gpu_arena" not in grown(before, counts("node_a"))


@pytest.mark.xfail(
    strict=True, reason="GPU arenas are not wired into the agent yet (issue 16): no CUDA IPC"
)
def test_same_node_cuda_tensor_moves_by_cuda_ipc(gpu_cluster: Any) -> None:
    """The goal: a consumer on the owner's node maps the owner's GPU arena (CUDA IPC); no
    host staging, no network path."""
    before = counts("node_a")
    handle, expected = ray.get(put_on_a.remote(64 * MiB, 5))
    assert ray.get(fetch_on_a.remote(handle)) == ("cuda:0", expected)
    assert "device:no_gpu_arena" not in grown(before, counts("node_a"))


def cuda_tensors(n: int) -> list[Any]:
    """Two CUDA tensors, one bfloat16; the same values in any process on this GPU."""
    g = torch.Generator(device="cuda").manual_seed(n)
    return [
        torch.randn(n, device="cuda", generator=g),
        torch.randn(7, 3, device="cuda", generator=g).to(torch.bfloat16),
    ]


@ray.remote(**ON_A)
class CudaSource:
    @ray.method(tensor_transport="VELO")
    def tensors(self, n: int) -> list[Any]:
        return cuda_tensors(n)


@ray.remote(**ON_B, enable_tensor_transport=True)
class CudaSink:
    def describe(self, values: list[Any]) -> list[tuple[str, int]]:
        return [(str(v.device), crc(v)) for v in values]


def test_velo_transport_moves_cuda_tensors(gpu_cluster: Any) -> None:
    """A method returning CUDA tensors (bfloat16 included) through "VELO": the receiver on
    node b gets CUDA tensors with the same bytes."""
    source, sink = CudaSource.remote(), CudaSink.remote()
    n = 1 << 20
    expected = cuda_tensors(n)
    described = ray.get(sink.describe.remote(source.tensors.remote(n)))
    assert described == [("cuda:0", crc(v)) for v in expected]
