"""CUDA tensors without a GPU: the type header carries the device, the staging fallback
through host memory is counted, and fetch's device rule is checked before anything moves.

A "CUDA" tensor here is a CPU tensor whose ``device`` says cuda (``ray_velo.testing.device.fake_cuda``), so
the payload layer takes the CUDA branch; the copies to and from the device are spied on.
tests/gpu runs the same paths with real device memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_velo.client import payload
from ray_velo.errors import ConfigError, UnsupportedPayload
from ray_velo.protocol import Ready, TypeHeader, decode_acquire_response, encode
from ray_velo.protocol.messages import decode
from ray_velo.testing import AgentPair

torch = pytest.importorskip("torch")

from ray_velo.testing.device import fake_cuda  # noqa: E402 (after the importorskip)

MiB = 1 << 20


@pytest.fixture()
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors copied device-to-host by staging."""
    seen: list[tuple[int, ...]] = []
    real = payload.host_tensor

    def spy(tensor: Any) -> Any:
        seen.append(tuple(tensor.shape))
        return torch.Tensor(real(tensor))  # a plain CPU tensor, as .cpu() gives

    monkeypatch.setattr(payload, "host_tensor", spy)
    return seen


@pytest.fixture()
def device_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Pretend this process has two CUDA devices (current: 1); record each host-to-device
    copy's target and return a CPU tensor with the values."""
    targets: list[str] = []

    def to_device(torch_module: Any, array: np.ndarray[Any, Any], device: str) -> Any:
        targets.append(device)
        return torch_module.from_numpy(array.copy())

    monkeypatch.setattr(payload, "_cuda_facts", lambda load_torch=False: (2, 1))
    monkeypatch.setattr(payload, "_to_device", to_device)
    return targets


# --- the type header --------------------------------------------------------------------


def test_type_header_device_is_on_the_wire_and_defaults_to_cpu() -> None:
    """A new owner's header says cuda; an old owner's (no field) means cpu, as before."""
    header = TypeHeader("torch", "<f4", (2, 3), device="cuda")
    assert decode_acquire_response(encode(Ready(total_len=24, type_header=header))) == Ready(
        total_len=24, type_header=header
    )
    assert decode(TypeHeader, encode({"kind": "torch", "dtype": "<f4"})).device == "cpu"


# --- staging a CUDA tensor ----------------------------------------------------------------


def test_a_cuda_tensor_stages_through_one_host_copy(host_copies: list[tuple[int, ...]]) -> None:
    """put of a CUDA tensor is accepted: one device-to-host copy, header device cuda."""
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    header, view = payload.as_bytes_view(fake_cuda(values))
    assert header == TypeHeader("torch", "<f4", (3, 4), device="cuda")
    assert host_copies == [(3, 4)]
    assert bytes(view) == values.numpy().tobytes()
    assert payload.payload_nbytes(fake_cuda(values)) == 48  # @rv.transfer stages it too


def test_unsupported_cuda_dtypes_and_devices_are_refused_before_any_copy(
    host_copies: list[tuple[int, ...]],
) -> None:
    """bfloat16 has no numpy dtype: refused without a wasted device copy; a tensor on a
    device that is neither cpu nor cuda (meta here) is refused by name."""
    with pytest.raises(UnsupportedPayload, match="bfloat16"):
        payload.as_bytes_view(fake_cuda(torch.zeros(4, dtype=torch.bfloat16)))
    with pytest.raises(UnsupportedPayload, match="torch tensor on meta"):
        payload.as_bytes_view(torch.empty(4, device="meta"))
    assert host_copies == []
    assert payload.payload_nbytes(torch.empty(4, device="meta")) is None


# --- where fetch rebuilds it --------------------------------------------------------------


@pytest.mark.parametrize(
    ("staged", "requested", "gpus", "expected"),
    [
        ("cuda", None, 2, "cuda:1"),  # the consumer's current device
        ("cuda", None, 0, "cpu"),  # a consumer without a GPU gets a CPU tensor
        ("cpu", None, 2, "cpu"),  # a CPU tensor stays on the CPU
        ("cpu", "cuda", 2, "cuda:1"),
        ("cuda", "cuda:0", 2, "cuda:0"),
        ("cuda", "cpu", 2, "cpu"),
        ("cuda", "cpu:0", 0, "cpu"),
    ],
)
def test_fetch_device_rule(staged: str, requested: str | None, gpus: int, expected: str) -> None:
    """The caller's device wins; else CUDA-staged goes to the current device, if any."""
    assert payload.fetch_device(staged, requested, gpus, 1 if gpus else 0) == expected


@pytest.mark.parametrize(
    ("requested", "gpus", "rule"),
    [
        ("cuda", 0, "sees 0 CUDA device"),
        ("cuda:2", 2, "sees 2 CUDA device"),
        ("mps", 2, "must be cpu, cuda or cuda:N"),
        ("cuda:x", 2, "must be cpu, cuda or cuda:N"),
        ("cpu:1", 2, "must be cpu, cuda or cuda:N"),
    ],
)
def test_fetch_device_refusals_name_the_rule(requested: str, gpus: int, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule):
        payload.fetch_device("cuda", requested, gpus, 0)


def test_naming_a_missing_gpu_fails_before_the_fetch() -> None:
    """check_fetch_device runs before the lease: nothing is fetched or consumed."""
    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device: the refusal needs a CPU-only one")
    with pytest.raises(ConfigError, match="device"):
        payload.check_fetch_device("cuda")
    assert payload.check_fetch_device(torch.device("cpu")) == "cpu"
    assert payload.check_fetch_device(None) is None


def test_a_cuda_tensor_is_rebuilt_on_the_current_device(device_copies: list[str]) -> None:
    """One host-to-device copy straight from the (read-only) fetched bytes, no host copy."""
    values = np.arange(6, dtype=np.float32)
    data = values.tobytes()
    header = TypeHeader("torch", "<f4", (2, 3), device="cuda")
    out = payload.from_bytes_view(header, memoryview(data), copy=True)
    assert device_copies == ["cuda:1"]
    assert out.tolist() == values.reshape(2, 3).tolist()
    out = payload.from_bytes_view(header, memoryview(data), copy=True, device="cpu")
    assert device_copies == ["cuda:1"] and out.device.type == "cpu"
    payload.from_bytes_view(TypeHeader("torch", "<f4", (6,)), data, device="cuda:0")
    assert device_copies == ["cuda:1", "cuda:0"]


def test_without_a_gpu_the_consumer_gets_a_cpu_tensor() -> None:
    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device")
    header = TypeHeader("torch", "<i8", (3,), device="cuda")
    out = payload.from_bytes_view(header, np.arange(3, dtype=np.int64).tobytes())
    assert out.device.type == "cpu" and out.tolist() == [0, 1, 2]


# --- through two real agents --------------------------------------------------------------


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm") as p:
        yield p
        p.validate()


def test_a_cuda_tensor_crosses_nodes_staged_through_host_and_counted(
    pair: AgentPair, host_copies: list[tuple[int, ...]]
) -> None:
    """An owner node with no GPU arena: the producer copies the tensor to host memory once,
    the owner counts velo_device_staged{reason=no_gpu_arena}, the host bytes take the RDMA
    path, and the consumer's header still says cuda (so it rebuilds on its GPU, or the CPU)."""
    values = torch.arange(MiB, dtype=torch.float32)  # 4 MiB: above rdma_min_bytes
    handle = pair.put(fake_cuda(values))
    staged = pair.owner.core.metrics.snapshot()["velo_device_staged_total"]
    assert staged == {"no_gpu_arena": 1, "gpu_budget": 0, "gpu_pool_exhausted": 0}
    assert host_copies == [(MiB,)]
    lease = pair.lease(handle)
    try:
        assert lease.type_header.device == "cuda"
        rebuilt = payload.from_bytes_view(lease.type_header, pair.read(lease), device="cpu")
    finally:
        pair.end(lease)
    assert torch.equal(rebuilt, values)
    assert pair.consumer_paths().get("rdma/ok") == 1


def test_a_cpu_tensor_counts_no_device_staging(pair: AgentPair) -> None:
    pair.put(torch.ones(1024))
    staged = pair.owner.core.metrics.snapshot()["velo_device_staged_total"]
    assert sum(staged.values()) == 0


def test_device_staging_is_exported_with_every_reason() -> None:
    """velo_device_staged{reason} exists at 0 for each reason and counts in the standalone
    Prometheus rendering (Ray's export primes the same labels)."""
    from prometheus_client import generate_latest

    from ray_velo.metrics import AgentMetrics, prometheus_registry

    metrics = AgentMetrics("n1", export_to_ray=False)
    metrics.device_staged("gpu_pool_exhausted")
    text = generate_latest(prometheus_registry({"n1": metrics.snapshot()})).decode()
    assert 'velo_device_staged_total{node="n1",reason="gpu_pool_exhausted"} 1.0' in text
    assert 'velo_device_staged_total{node="n1",reason="no_gpu_arena"} 0.0' in text
    assert 'velo_device_staged_total{node="n1",reason="gpu_budget"} 0.0' in text


def test_a_tensor_numpy_cannot_view_is_refused_as_unsupported() -> None:
    """torch's own refusal (a conjugate-bit tensor) is mapped at the boundary."""
    with pytest.raises(UnsupportedPayload, match="conjugate"):
        payload.as_bytes_view(torch.ones(3, dtype=torch.complex64).conj())
