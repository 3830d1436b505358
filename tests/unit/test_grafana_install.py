"""``ray-velo grafana``: the packaged dashboard lands where Ray's Grafana provisioning reads it.

Runs the CLI in this process (``ray_velo.cli.main(argv)``); no Ray cluster. Every route is
pointed at a temporary directory, so nothing is written below ``/tmp/ray``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from ray_velo import cli, ops

ENV_VAR = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"


def packaged_dashboard() -> Any:
    return json.loads(resources.files("ray_velo").joinpath("grafana_dashboard.json").read_text())


def installed_dashboard(directory: Path) -> Any:
    """The JSON installed in ``directory``, checking it is the only file there."""
    assert sorted(p.name for p in directory.iterdir()) == [ops.DASHBOARD_FILE]
    return json.loads((directory / ops.DASHBOARD_FILE).read_text())


@pytest.fixture(autouse=True)
def no_dashboard_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that sets the variable must not send these installs into its real Grafana."""
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_dir_installs_the_packaged_dashboard_under_its_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator names the folder their Grafana reads: the dashboard is copied there, under
    ray_velo's own name beside Ray's, byte for byte the packaged JSON, and the CLI says where."""
    target = tmp_path / "not" / "yet" / "made"
    assert cli.main(["grafana", "--dir", str(target)]) == 0
    assert installed_dashboard(target) == packaged_dashboard()
    assert (target / ops.DASHBOARD_FILE).read_bytes() == (
        resources.files("ray_velo").joinpath("grafana_dashboard.json").read_bytes()
    )
    assert str(target / ops.DASHBOARD_FILE) in capsys.readouterr().out


def test_installing_again_overwrites_an_older_copy(tmp_path: Path) -> None:
    """An upgrade reinstalls over last version's file: the new dashboard replaces it."""
    (tmp_path / ops.DASHBOARD_FILE).write_text('{"title": "an older ray_velo"}')
    assert cli.main(["grafana", "--dir", str(tmp_path)]) == 0
    assert installed_dashboard(tmp_path) == packaged_dashboard()


def test_the_environment_variable_names_the_folder_ray_writes_its_dashboards_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster started with RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR: Ray writes its
    dashboards there, so ours goes there too, even when a session directory is named."""
    configured = tmp_path / "grafana-dashboards"
    session = tmp_path / "session"
    monkeypatch.setenv(ENV_VAR, str(configured))
    assert cli.main(["grafana", "--session-dir", str(session)]) == 0
    assert installed_dashboard(configured) == packaged_dashboard()
    assert not session.exists()


def test_dir_wins_over_the_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit --dir is what the operator asked for, whatever the environment says."""
    configured = tmp_path / "from-env"
    chosen = tmp_path / "chosen"
    monkeypatch.setenv(ENV_VAR, str(configured))
    assert cli.main(["grafana", "--dir", str(chosen)]) == 0
    assert installed_dashboard(chosen) == packaged_dashboard()
    assert not configured.exists()


def test_session_dir_installs_into_the_sessions_grafana_dashboards_folder(tmp_path: Path) -> None:
    """No variable set: Ray's Grafana provisioning reads <session>/metrics/grafana/dashboards,
    so that is where the dashboard goes for the session named."""
    session = tmp_path / "session_2024-01-01_00-00-00_000000_1"
    assert cli.main(["grafana", "--session-dir", str(session)]) == 0
    folder = session / "metrics" / "grafana" / "dashboards"
    assert installed_dashboard(folder) == packaged_dashboard()
    assert ops.dashboard_dir(str(session)) == str(folder)


def test_without_a_session_dir_the_latest_session_is_meant() -> None:
    """No flag and no variable: the running cluster's session (Ray's session_latest link)."""
    assert ops.dashboard_dir() == "/tmp/ray/session_latest/metrics/grafana/dashboards"
