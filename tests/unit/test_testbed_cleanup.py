"""The testbed's cleanup after the processes it started ended: their shared-memory segments
and their agents' Unix sockets go, nobody else's."""

from __future__ import annotations

from pathlib import Path

from ray_velo.testbed.cluster import remove_segments_of


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
