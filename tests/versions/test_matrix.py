"""Every Ray ray_velo claims, tested: the version smoke (tests/versions/smoke.py) on the
oldest Ray the project claims (2.40, no tensor-transport API, no token auth), on the first
Ray with the tensor-transport API as ray_velo uses it (2.55, with Ray's token auth on), and on
this interpreter's Ray with token auth off (the full suite runs it with token auth on; 2.55
with auth off was dropped from CI's budget: the same code path as this Ray with auth off). Each older Ray gets a virtual environment of its own that sees this interpreter's
packages (ray_velo, numpy, torch...) and only swaps Ray, cached under ~/.cache/ray_velo
between runs. Skipped, loudly, where pip cannot install that Ray (no package index)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import ray_velo
from ray_velo import _ray

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

SMOKE = Path(__file__).with_name("smoke.py")
CACHE = Path(os.environ.get("RAY_VELO_VENV_CACHE", Path.home() / ".cache" / "ray_velo" / "venvs"))
#: (Ray version, auth mode): the claimed lower bound, the tensor-transport lower bound, and
#: this interpreter's Ray (None).
MATRIX = [("2.40.0", "disabled"), ("2.55.0", "token"), (None, "disabled")]
FEATURES = ("put/fetch", "@transfer", "stream", "tensor transport", "status --json", "job end")


def interpreter_for(version: str | None) -> str:
    """A Python whose ``import ray`` is Ray ``version`` (this one for None)."""
    if version is None:
        return sys.executable
    where = CACHE / f"ray-{version}-py{sys.version_info.major}{sys.version_info.minor}"
    python = where / "bin" / "python"
    check = [str(python), "-c", f"import ray, sys; sys.exit(ray.__version__ != {version!r})"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return str(python)
    venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(where)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", f"ray=={version}"],
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(
            f"SKIPPED (no package index): pip cannot install ray=={version}: {done.stderr[-400:]}"
        )
    return str(python)


@pytest.mark.parametrize(("version", "auth"), MATRIX, ids=lambda v: str(v or "this-ray"))
def test_the_smoke_passes_on_every_claimed_ray(version: str | None, auth: str) -> None:
    """On each Ray version (and auth mode), each feature works, or, where that Ray lacks what
    it needs, is refused with the Ray version it needs (never an AttributeError from inside)."""
    python = interpreter_for(version)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["RAY_AUTH_MODE"] = auth
    if auth == "token":
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env["PYTHONPATH"] = str(Path(ray_velo.__file__).parents[1])
    done = subprocess.run(
        [python, str(SMOKE)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SMOKE ")]
    assert lines, f"the smoke exited {done.returncode}:\n{done.stderr[-3000:]}"
    result = json.loads(lines[-1][len("SMOKE ") :])
    ray_version = version or _ray.version_text()
    assert result["ray"] == ray_version
    has_rdt = _ray._parse(ray_version) >= _ray.RDT_MIN_VERSION
    expected_auth = "none" if _ray._parse(ray_version) < (2, 52, 0) else auth
    assert result["auth_seen"] == expected_auth, result
    for feature in FEATURES:
        outcome = result[feature]
        if feature == "tensor transport" and not has_rdt:
            assert outcome.startswith("skipped:") and "needs Ray >= 2.55.0" in outcome, outcome
        else:
            assert outcome.startswith("ok"), f"{feature} on Ray {ray_version}: {outcome}"
