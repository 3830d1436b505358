"""The GPU benchmark of issue 16: two processes on one GPU move a CUDA tensor three ways
(docs/gpu.md, "Commands for a GPU machine"). Nothing runs on import."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GpuBenchResult", "format_gpu_bench", "run_gpu_bench", "ucx_raw_cuda_get"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuBenchResult:
    """Median seconds per move of ``nbytes``; None where a column could not run."""

    nbytes: int
    reps: int
    velo_s: float
    ray_s: float
    ucx_raw_s: float | None
    nixl: str
    velo_device_staged: dict[str, int]

    def gbps(self, seconds: float | None) -> float | None:
        return None if not seconds else self.nbytes / seconds / 1e9

    @property
    def velo_vs_raw(self) -> float | None:
        """ray_velo's bandwidth over the bare GET's (bar: >= 0.8)."""
        return None if self.ucx_raw_s is None else self.ucx_raw_s / self.velo_s

    @property
    def velo_vs_ray(self) -> float:
        """ray_velo's bandwidth over Ray's object store's (bar: >= 5)."""
        return self.ray_s / self.velo_s


# --- the bare UCX ceiling ---------------------------------------------------------------


def _raw_owner(conn: Any, nbytes: int) -> None:
    import torch

    from ray_velo.protocol.memtype import MemoryType
    from ray_velo.ucx.binding import MemoryRegistration, UcxContext, UcxWorker

    context = UcxContext()
    worker = UcxWorker(context)
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    registration = MemoryRegistration.from_address(
        context, src.data_ptr(), nbytes, keepalive=src, memory_type=MemoryType.CUDA
    )
    conn.send((worker.address, src.data_ptr(), registration.packed_rkey))
    conn.recv()  # the consumer is done
    context.close()


def _raw_consumer(conn: Any, nbytes: int, reps: int) -> None:
    import torch

    from ray_velo.protocol.memtype import SUPPORTED_MEMORY_TYPES, MemoryType
    from ray_velo.ucx.binding import (
        Endpoint,
        MemoryRegistration,
        RemoteKey,
        UcxContext,
        UcxWorker,
        get,
    )

    address, remote_addr, rkey_blob = conn.recv()
    context = UcxContext()
    worker = UcxWorker(context)
    dest = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    local = MemoryRegistration.from_address(
        context, dest.data_ptr(), nbytes, keepalive=dest, memory_type=MemoryType.CUDA
    )
    endpoint = Endpoint(worker, address)
    rkey = RemoteKey(endpoint, rkey_blob, SUPPORTED_MEMORY_TYPES)
    get(endpoint, dest.data_ptr(), min(nbytes, 4096), remote_addr, rkey, 30.0, local_memh=local)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        get(endpoint, dest.data_ptr(), nbytes, remote_addr, rkey, 60.0, local_memh=local)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    ok = bool((dest == 7).all())
    context.close()
    conn.send((statistics.median(times), ok))


def ucx_raw_cuda_get(nbytes: int, reps: int = 5) -> float:
    """Median seconds of a bare UCX GET of ``nbytes`` of CUDA memory into CUDA memory
    between two fresh processes on this GPU (UCX picks cuda_ipc).

    Raises:
        RuntimeError: the bytes came back wrong.
    """
    from ray_velo.bench.samehost import raw_pair

    return raw_pair(
        (_raw_owner, (nbytes,)),
        (_raw_consumer, (nbytes, reps)),
        "bare UCX GET of CUDA memory returned wrong bytes",
    )


# --- ray_velo and Ray's object store -----------------------------------------------------


def _actors() -> tuple[Any, Any]:
    import ray
    import torch

    import ray_velo as rv

    class Producer:
        def make(self, nbytes: int) -> int:
            self.tensor = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
            return _crc(self.tensor)

        def velo_put(self) -> rv.DataHandle:
            return rv.put(self.tensor)

        def ray_put(self) -> list[Any]:
            return [ray.put(self.tensor)]  # in a list: the consumer's ray.get is timed

    class Consumer:
        def velo_fetch(self, handle: rv.DataHandle) -> tuple[float, int]:
            started = time.perf_counter()
            tensor = rv.fetch(handle)
            torch.cuda.synchronize()
            return time.perf_counter() - started, _crc(tensor)

        def ray_get(self, refs: list[Any]) -> tuple[float, int]:
            started = time.perf_counter()
            tensor = ray.get(refs[0]).to("cuda")  # a no-op when Ray restored it on the GPU
            torch.cuda.synchronize()
            return time.perf_counter() - started, _crc(tensor)

    half_a_gpu: Any = ray.remote(num_gpus=0.5, num_cpus=0)
    return half_a_gpu(Producer).remote(), half_a_gpu(Consumer).remote()


def _crc(tensor: Any) -> int:
    return zlib.crc32(tensor.reshape(-1).cpu().numpy()[:: 1 << 12].tobytes())


def _timed(producer: Any, consumer: Any, column: str, reps: int, expected: int) -> float:
    import ray

    times = []
    for _ in range(reps):
        if column == "velo":
            seconds, got = ray.get(consumer.velo_fetch.remote(producer.velo_put.remote()))
        else:
            seconds, got = ray.get(consumer.ray_get.remote(producer.ray_put.remote()))
        if got != expected:
            raise RuntimeError(f"{column}: the consumer's tensor has other bytes")
        times.append(seconds)
    return float(statistics.median(times))


def run_gpu_bench(nbytes: int = 256 * MiB, reps: int = 5, *, raw: bool = True) -> GpuBenchResult:
    """Measure the three columns for ``nbytes`` (starts a local Ray cluster if none).

    Raises:
        RuntimeError: no CUDA device, or a column returned wrong bytes.
    """
    import ray
    import torch

    import ray_velo as rv

    if not torch.cuda.is_available():
        raise RuntimeError("the GPU benchmark needs a CUDA device (torch.cuda.is_available())")
    ucx_raw_s = ucx_raw_cuda_get(nbytes, reps) if raw else None  # before Ray: no fork after
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=rv.runtime_env(),
        )
    rv.init()
    try:
        producer, consumer = _actors()
        expected = ray.get(producer.make.remote(nbytes))
        velo_s = _timed(producer, consumer, "velo", reps, expected)
        ray_s = _timed(producer, consumer, "ray", reps, expected)
        staged = _device_staged()
    finally:
        rv.shutdown(stop_ray=started_ray)
    has_nixl = importlib.util.find_spec("nixl") is not None
    nixl = "importable (run Ray's NIXL transport beside it)" if has_nixl else "not installed"
    return GpuBenchResult(nbytes, reps, velo_s, ray_s, ucx_raw_s, nixl, staged)


def _device_staged() -> dict[str, int]:
    import ray

    from ray_velo.actors import alive_node_ids, ensure_agent

    total: dict[str, int] = {}
    for node in alive_node_ids():
        agent = ensure_agent(node)  # held: Ray 2.40's method keeps only a weak reference
        info = ray.get(agent.info.remote())
        for reason, n in info["metrics"].get("velo_device_staged_total", {}).items():
            total[reason] = total.get(reason, 0) + n
    return total


def format_gpu_bench(result: GpuBenchResult) -> str:
    """The table the issue note quotes."""

    def row(name: str, seconds: float | None) -> str:
        if seconds is None:
            return f"{name:<10} {'-':>10} {'-':>8}"
        return f"{name:<10} {seconds * 1e3:>8.1f}ms {result.gbps(seconds) or 0:>6.2f}GB/s"

    raw = result.velo_vs_raw
    lines = [
        f"GPU to GPU, two processes on one GPU: {result.nbytes // MiB} MiB, "
        f"median of {result.reps}",
        row("velo", result.velo_s),
        row("ucx_raw", result.ucx_raw_s),
        row("ray", result.ray_s),
        f"velo vs bare UCX GET: {'-' if raw is None else f'{raw:.2f}x'} (bar >= 0.8x)",
        f"velo vs Ray object store: {result.velo_vs_ray:.2f}x (bar >= 5x)",
        f"velo_device_staged (host bounces): {result.velo_device_staged}",
        f"NIXL VRAM READ: {result.nixl}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_velo.bench.gpu", description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-ucx-raw", action="store_true", help="skip the bare UCX column")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead")
    parser.add_argument("--out", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    result = run_gpu_bench(args.size_mib * MiB, args.reps, raw=not args.no_ucx_raw)
    print(json.dumps(asdict(result), indent=2) if args.json else format_gpu_bench(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
