"""The testbed's cleanup after the processes it started ended: their shared-memory segments
and their agents' Unix sockets go, nobody else's."""

from __future__ import annotations

from pathlib import Path

from ray_velo.testbed.cluster import logged_worker_pids, remove_segments_of


def test_only_the_ended_processes_segments_and_sockets_are_removed(tmp_path: Path) -> None:
    mine = ["ray_velo-4242-00000000000000aa-0", "ray_velo_agent-4242-00000000000000aa.sock"]
    others = [
        "ray_velo-4243-00000000000000bb-0",  # another process
        "ray_velo_agent-42420-00000000000000cc.sock",  # a pid that starts the same
        "unrelated-4242-file",
    ]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_segments_of([4242], str(tmp_path))) == sorted(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)


def test_workers_that_died_before_teardown_are_found_in_the_ray_logs(tmp_path: Path) -> None:
    """A worker Ray killed before the testbed closed (an agent ended with its job, an actor
    the memory monitor killed) is in no namespace any more: its log names its pid, so its
    segments are removed with the rest (a 3 GiB arena was left behind once)."""
    logs = tmp_path / "session_2026-12-03_21-25-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    for name in (
        "python-core-worker-218084436ca6bf88ab1c5686671ff54f06d62ee7c7d6b9dbe12e5076_4549.log",
        "worker-218084436ca6bf88ab1c5686671ff54f06d62ee7c7d6b9dbe12e5076-01000000-4549.err",
        "worker-372cc137955f1b04476529d6f58789afd634fc538e2b59577282c397-01000000-4043.out",
        "raylet.out",
        "gcs_server.err",
        "dashboard_agent.1.log",
    ):
        (logs / name).write_text("")
    (tmp_path / "worker-abc-01000000-77.out").write_text("")  # not under a logs dir
    assert logged_worker_pids(str(tmp_path)) == [4043, 4549]
    assert logged_worker_pids(str(tmp_path / "missing")) == []
