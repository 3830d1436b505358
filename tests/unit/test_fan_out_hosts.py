"""The fan-out bench's pure parts: where the K readers go, and the table it prints (no Ray)."""

from __future__ import annotations

import pytest

from ray_velo.bench.fanout import format_fan_out, hosts_text, reader_hosts

MiB = 1 << 20


def test_readers_go_round_robin_over_every_host_but_a() -> None:
    """The issue's case, 2 readers on 3 hosts, puts one on b and one on c; more readers
    than reader hosts wrap around; two hosts keep every reader on b, as before."""
    assert reader_hosts(2, 3) == [1, 2]
    assert reader_hosts(5, 3) == [1, 2, 1, 2, 1]
    assert reader_hosts(3, 2) == [1, 1, 1]
    assert reader_hosts(1, 4) == [1]  # hosts c and d get no reader
    assert hosts_text(reader_hosts(2, 3)) == "hosts b, c"
    assert hosts_text(reader_hosts(3, 2)) == "host b"


@pytest.mark.parametrize(("k", "hosts"), [(2, 1), (0, 3)])
def test_no_fan_out_without_a_reader_host_or_a_reader(k: int, hosts: int) -> None:
    with pytest.raises(ValueError, match="at least"):
        reader_hosts(k, hosts)


def test_the_table_names_the_reader_hosts_and_the_relays() -> None:
    """A 3-host run of 256 MiB to 2 readers: the title names b and c, the columns stay, and
    the per-link line says how many transfers were relayed."""
    rows = {
        "10gbit": {
            "ray": 0.600,
            "velo": 0.300,
            "velo_one": 0.250,
            "velo_transfers": 2.0,
            "velo_relayed": 1.0,
            "velo_copies": 0.0,
        }
    }
    text = format_fan_out(rows, k=2, size=256 * MiB, reps=5, hosts=3)
    lines = text.splitlines()
    assert lines[0] == "256 MiB to 2 readers on hosts b, c at once, median of 5 rounds:"
    for column in ("Ray x2", "velo x2", "velo x1", "velo/Ray speed", "velo xK / x1"):
        assert column in lines[1]
    assert lines[3].split() == ["10gbit", "600ms", "300ms", "250ms", "2.00x", "1.20x"]
    assert "the agents of hosts b, c" in lines[4]
    assert "2.0 times for 2 readers (1.0 relayed from another reader's copy" in lines[4]
    assert "0.0 read a node-local copy" in lines[4]


def test_the_two_host_table_keeps_host_b_and_tolerates_missing_counts() -> None:
    """The default two-host run reads as before; a row without counters prints zeros."""
    rows = {"none": {"ray": 0.5, "velo": 0.25, "velo_one": 0.25}}
    text = format_fan_out(rows, k=3, size=256 * MiB, reps=7)
    assert text.startswith("256 MiB to 3 readers on host b at once, median of 7 rounds:")
    assert "host b's agent moved the bytes over a link 0.0 times" in text
    assert "(0.0 relayed" in text


def test_the_weights_table_puts_each_transport_beside_its_one_reader_time() -> None:
    """``--transport --fan-out 4 --hosts 5``: a line per transport with one reader's time,
    K's and K's over one's, the raw link's (one stream, a chain of K at once); under it, how
    often host a's link carried VELO's weights."""
    from ray_velo.bench.broadcast import format_broadcast

    rows = {
        "1gbit": {
            "seconds": dict(velo=4.4, velo_one=4.0, nixl=17.0, nixl_one=4.25, ray=9.0, ray_one=4.5),
            "velo_moved": {"transfers": 4.0, "relayed": 3.0, "copies": 0.0, "inline": 0.0},
            "consistent": True,
            "size_bytes": 497_759_232,
            "reps": 5,
            "nixl": True,
            "raw_one": 3.6,
            "raw_chain": 4.14,
        }
    }
    lines = format_broadcast(rows, k=4, hosts=5).splitlines()
    assert lines[0].startswith("one weights ref (GPT-2 small's state dict, 498 MB, 148 tensors)")
    assert "to 4 rollout actors on hosts b, c, d, e, median of 5 rounds" in lines[0]
    assert lines[3].split() == ["1gbit", "VELO", "4000ms", "4400ms", "1.10x"]
    assert lines[4].split() == ["NIXL", "4250ms", "17000ms", "4.00x"]
    assert lines[5].split() == ["Ray's", "store", "4500ms", "9000ms", "2.00x"]
    assert lines[6].split()[:5] == ["raw", "link", "3600ms", "4140ms", "1.15x"]
    assert "4.0 times, 3.0 of them from another receiver's copy" in lines[7]
    assert "(host a's link carried them 1.0 times)" in lines[7]
    assert "WARNING" not in "\n".join(lines)
