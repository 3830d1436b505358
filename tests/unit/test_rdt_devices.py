"""The "VELO" tensor transport with CUDA tensors, without a GPU or a Ray cluster: which
devices it declares, how a CUDA object is staged (one host copy each, said to the agent),
and where a receiver puts the tensors. Staging and fetching are stubbed at the session;
tests/on_ray/test_rdt.py and tests/gpu run them for real."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_velo import rdt  # noqa: E402 (after the importorskip)
from ray_velo.client import payload  # noqa: E402
from ray_velo.protocol import DataHandle  # noqa: E402
from ray_velo.testing.device import fake_cuda  # noqa: E402 (after the importorskip)


@pytest.fixture()
def staged(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, str | None]]:
    """What the transport stages: each payload's bytes and the device it says they came from."""
    calls: list[tuple[bytes, str | None]] = []

    def stage_packed(parts: list[Any], **kwargs: Any) -> tuple[DataHandle, list[int]]:
        calls.extend((np.asarray(part).tobytes(), kwargs.get("staged_from")) for part in parts)
        return DataHandle(7, 1), rdt.session.pack_layout([part.nbytes for part in parts])[0]

    monkeypatch.setattr(rdt.session, "stage_packed", stage_packed)
    monkeypatch.setattr(rdt, "host_tensor", lambda t: torch.Tensor(t.detach().contiguous()))
    return calls


def test_declared_devices() -> None:
    """VELO takes CPU and CUDA tensors (Ray checks the object's device against this);
    VELO_NUMPY only host arrays."""
    assert rdt.VeloTensorTransport.devices == ("cpu", "cuda")
    assert rdt.VeloNumpyTransport.devices == ("cpu",)


def test_a_cuda_object_is_staged_through_host_and_says_so(
    staged: list[tuple[bytes, str | None]],
) -> None:
    """Two CUDA tensors (one bfloat16: raw bytes travel): packed into one slot, each from a
    host copy, marked staged_from="cuda" so the agent counts it; the metadata says cuda."""
    values = [torch.arange(6, dtype=torch.float32), torch.ones(4, dtype=torch.bfloat16)]
    meta = rdt.VeloTensorTransport().extract_tensor_transport_metadata(
        "obj", [fake_cuda(v) for v in values]
    )
    assert meta.tensor_device == "cuda" and meta.handle == DataHandle(7, 1)
    assert meta.offsets == [0, 64] and meta.nbytes == 64 + 8
    assert [from_ for _, from_ in staged] == ["cuda", "cuda"]
    assert staged[0][0] == values[0].numpy().tobytes()
    assert staged[1][0] == values[1].view(torch.uint8).numpy().tobytes()


def test_mixed_devices_are_refused(staged: list[tuple[bytes, str | None]]) -> None:
    with pytest.raises(ValueError, match="one device type"):
        rdt.VeloTensorTransport().extract_tensor_transport_metadata(
            "obj", [torch.zeros(2), fake_cuda(torch.zeros(2))]
        )
    assert staged == []


def receive(
    monkeypatch: pytest.MonkeyPatch, device: str | None, gpus: int, targets: Any = None
) -> tuple[list[Any], list[str]]:
    """recv_multiple_tensors of one 3-element float tensor staged from ``device``, on a
    receiver that sees ``gpus`` CUDA devices; the host-to-device copies it asked for."""
    moved: list[str] = []

    def to_fetch_device(tensor: Any, staged_from: str, requested: str | None = None) -> Any:
        target = payload.fetch_device(staged_from, requested, gpus, 0)
        if target != "cpu":
            moved.append(target)
        return tensor

    transport = rdt.VeloTensorTransport()
    monkeypatch.setattr(rdt, "to_fetch_device", to_fetch_device)
    slot = np.array([1.0, 2.0, 3.0], dtype=np.float32).view(np.uint8)
    monkeypatch.setattr(transport, "_fetch", lambda *args: slot.copy())
    meta = rdt.VeloTransportMetadata(
        tensor_meta=[((3,), torch.float32)],
        tensor_device=device,
        handle=DataHandle(7, 1),
        nbytes=12,
        offsets=[0],
    )
    out = transport.recv_multiple_tensors("obj", meta, rdt.VeloCommunicatorMetadata(), targets)
    return out, moved


def test_a_receiver_with_a_gpu_gets_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    out, moved = receive(monkeypatch, "cuda", gpus=1)
    assert moved == ["cuda:0"] and out[0].tolist() == [1.0, 2.0, 3.0]


def test_a_receiver_without_a_gpu_gets_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    out, moved = receive(monkeypatch, "cuda", gpus=0)
    assert moved == [] and out[0].device.type == "cpu"
    _, moved = receive(monkeypatch, "cpu", gpus=1)
    assert moved == []  # a CPU object stays on the CPU


def test_a_device_target_buffer_is_filled_from_the_host_copy() -> None:
    """The copy into a CUDA target (here a CPU stand-in: the copy is device-agnostic) and
    its size check."""
    target = torch.zeros(2, 3)
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert rdt._fill_device_target(target, host) is target
    assert torch.equal(target, host)
    with pytest.raises(ValueError, match="holds 12 bytes"):
        rdt._fill_device_target(torch.zeros(3), host)
