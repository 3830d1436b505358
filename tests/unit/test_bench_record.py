"""Sittings (ray_velo.bench.record) and the bench command's refusals: what a bench run writes,
how two sittings are compared, and that bad input gets one line and exit 2, before anything is
measured. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_velo import cli
from ray_velo.bench.record import (
    SittingError,
    compare_sittings,
    load_sitting,
    make_sitting,
    write_sitting,
)


def sitting(velo_s: float, ray_s: float, shape: str = "256 MiB @10gbit") -> dict[str, object]:
    return make_sitting("shapes", {"raw": True}, {shape: {"velo": velo_s, "ray": ray_s}})


def test_a_sitting_names_the_commit_the_machine_and_the_versions(tmp_path: Path) -> None:
    """Written and read back: the shapes as given, and where they were measured."""
    path = str(tmp_path / "s.json")
    write_sitting(path, sitting(0.25, 0.5))
    back = load_sitting(path)
    assert back["shapes"] == {"256 MiB @10gbit": {"velo": 0.25, "ray": 0.5}}
    assert back["mode"] == "shapes" and back["results"] == {"raw": True}
    assert back["machine"]["cpus"] >= 1 and back["machine"]["memory_bytes"] > 0
    assert back["code"]["version"] and "commit" in back["code"]
    assert back["ray"] and back["date"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "not JSON"),
        ('{"schema": 1}', "no 'shapes'"),
        ('{"schema": 99, "shapes": {}}', "schema 99"),
    ],
)
def test_a_file_that_is_no_sitting_is_refused_by_name(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SittingError, match=says) as caught:
        load_sitting(str(path))
    assert str(path) in str(caught.value)


def test_compare_gives_the_second_sittings_speed_over_the_first() -> None:
    """B moved ray_velo's 256 MiB in half A's time: 2.00x; each sitting's velo/Ray too."""
    text = compare_sittings(sitting(0.5, 1.0), sitting(0.25, 1.0))
    velo_line = next(line for line in text.splitlines() if " velo " in line)
    assert velo_line.split()[-3:] == ["500.0", "250.0", "2.00x"]
    assert "velo/Ray A" in text and "2.00x" in text and "4.00x" in text


def test_sittings_with_no_shape_in_common_cannot_be_compared() -> None:
    with pytest.raises(SittingError, match="share no shape"):
        compare_sittings(sitting(1, 1, "a"), sitting(1, 1, "b"))


def test_the_cli_compares_two_sitting_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_sitting(str(a), sitting(0.5, 1.0))
    write_sitting(str(b), sitting(0.25, 1.0))
    assert cli.main(["bench", "--compare", str(a), str(b)]) == 0
    assert "2.00x" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--sizes", "abc"], "--sizes abc"),
        (["bench", "--sizes", "0"], "above 0 MiB"),
        (["bench", "--reps", "0"], "--reps 0"),
        (["bench", "--shapes"], "--shapes needs --two-host"),
        (["bench", "--fan-out", "2"], "--fan-out needs --two-host"),
        (["bench", "--hosts", "3"], "--hosts needs"),
        (["bench", "--decorator", "--calls"], "not allowed with"),
        (["bench", "--two-host", "--decorator"], "not with --two-host"),
        (["bench", "--transfers-only"], "--transfers-only"),
        (["bench", "--decorator", "--plot", "x.png"], "--plot"),
        (["bench", "--compare", "/nonexistent/a.json", "b.json"], "cannot read"),
        (["bench", "--out", "/nonexistent/dir/s.json", "--sizes", "1"], "cannot write"),
        (["bench", "--two-host", "--link", "fast"], "link rate 'fast'"),
        (["nonsense"], "invalid choice"),
        (
            ["bench", "--transport", "--without-nixl", "--plot", "/nonexistent/x.png"],
            "cannot write",
        ),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every refusal is one line on stderr naming what was wrong, before anything runs (the
    testbed's root check is stubbed where --two-host is given: the options are refused
    first or right after it)."""
    monkeypatch.setattr("ray_velo.testbed.check_privileges", lambda: None)
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2
    assert says in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from ray_velo import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ray-velo {__version__}"


def test_json_is_one_meaning_a_sitting_on_stdout(tmp_path: Path) -> None:
    """``--json`` prints (never names a file); ``--out`` names the file."""
    from ray_velo.bench.command import add_bench_command

    parser = cli._Parser(prog="ray-velo")
    add_bench_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--json", "--out", str(tmp_path / "s.json")])
    assert args.json is True and args.out == str(tmp_path / "s.json")
    json.dumps(vars(args), default=str)


def test_ranges_plot_draws_the_sittings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ranges FILES --plot PNG``: the table on stdout and a PNG of GB/s against size (a
    panel per link) from sittings whose shapes are named by size and link."""
    files = []
    for n, velo_s in enumerate((0.25, 0.30)):
        path = tmp_path / f"s{n}.json"
        shapes = {
            "16 MiB @10gbit": {"velo": velo_s / 16, "ray": 0.1, "raw_tcp": 0.014},
            "256 MiB @10gbit": {"velo": velo_s, "ray": 0.5, "raw_tcp": 0.22},
            "256 MiB unshaped": {"velo": velo_s / 2, "ray": 0.4},
        }
        write_sitting(str(path), make_sitting("shapes", {}, shapes))
        files.append(str(path))
    png = tmp_path / "curve.png"
    assert cli.main(["bench", "--ranges", *files, "--plot", str(png)]) == 0
    assert "| 256 MiB @10gbit |" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_of_sittings_without_sizes_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.json"
    write_sitting(str(path), sitting(0.5, 1.0, "state dict @10gbit"))
    status = cli.main(
        ["bench", "--ranges", str(path), str(path), "--plot", str(tmp_path / "x.png")]
    )
    err = capsys.readouterr().err
    assert status == 2 and "no shape" in err and len(err.strip().splitlines()) == 1


def test_transport_without_nixl_is_refused_unless_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where NIXL is not installed, or its package cannot load its backend (a CUDA 13 stack
    beside nixl-cu12 only), ``--transport`` (VELO beside NIXL) says why in one line and names
    the way on; nothing runs."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "nixl" else real_find_spec(name, *a),
    )
    assert cli.main(["bench", "--transport", "--sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "ray-velo[nixl]" in err and "--without-nixl" in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.undo()

    def broken_nixl(name: str) -> None:
        raise ImportError("detected CUDA 13 but nixl-cu13 is not installed")

    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "nixl" else real_find_spec(name, *a),
    )
    monkeypatch.setattr("importlib.import_module", broken_nixl)
    assert cli.main(["bench", "--transport", "--sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "nixl-cu13 is not installed" in err and "--without-nixl" in err
    assert len(err.strip().splitlines()) == 1


def test_weights_broadcast_sittings_give_each_transports_k_over_one_and_the_raw_chain() -> None:
    """``--two-host --transport --fan-out K`` sittings: VELO's one- and K-reader times, NIXL's
    and Ray's K-reader times, and the ranges of each one's K over one (the raw link's chain
    beside them), VELO over NIXL and over Ray."""
    from ray_velo.bench.record import ranges_table

    def weights(velo: float, nixl: float) -> dict[str, object]:
        row = {"velo": velo, "velo_one": 4.0, "nixl": nixl, "nixl_one": 4.0, "ray": 16.0}
        row |= {"ray_one": 8.0, "raw_one": 4.0, "raw_chain": 5.0}
        return make_sitting("weights broadcast", {}, {"state dict to 4 @1gbit": row})

    lines = ranges_table([weights(4.4, 16.0), weights(4.8, 17.6)]).splitlines()
    assert lines[0].split(" | ")[1:5] == [
        "VELO x1, ms",
        "VELO xK, ms",
        "NIXL xK, ms",
        "Ray's store xK, ms",
    ]
    cells = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert cells[0] == "state dict to 4 @1gbit"
    assert cells[1:5] == ["4000", "4400-4800", "16000-17600", "16000"]
    assert cells[5:9] == ["1.10-1.20x", "4.00-4.40x", "2.00x", "1.25x"]
    assert cells[9:] == ["3.64-3.67x", "3.33-3.64x"]
