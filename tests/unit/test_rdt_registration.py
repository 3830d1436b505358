"""How the VELO transports get registered in a process: the job's setup hook in every worker,
``VELO`` the moment torch is imported (never importing it for a worker that does not), and
the runtime env that carries the hook. Each scenario in a fresh interpreter: registration is
process state."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ray_velo as rv
from ray_velo import _ray

pytestmark = pytest.mark.skipif(
    not _ray.has_tensor_transport(), reason="this Ray has no tensor-transport API"
)

HOOK = "ray_velo.rdt.worker_setup"


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_setup_hook_registers_numpy_now_and_torch_when_imported() -> None:
    out = run(
        "import sys\n"
        "from ray.experimental.rdt.util import transport_manager_info as info\n"
        "from ray_velo.rdt import worker_setup\n"
        "worker_setup()\n"
        "print(sorted(info), 'torch' in sys.modules)\n"
        "import torch\n"
        "print(sorted(info), info['VELO'].data_type is torch.Tensor)\n"
    )
    assert out.splitlines() == ["['VELO_NUMPY'] False", "['VELO', 'VELO_NUMPY'] True"]


def test_importing_ray_velo_after_ray_registers_in_any_process() -> None:
    """What a worker that imports ray_velo (but has no hook) gets; Ray's own default
    transports, registered when Ray first imports torch, sit beside ours."""
    out = run(
        "import ray\n"
        "import ray_velo\n"
        "from ray.experimental.rdt.util import transport_manager_info as info, "
        "normalize_and_validate_tensor_transport as check\n"
        "print(sorted(info))\n"
        "print(check('velo'), sorted(info))\n"
    )
    first, second = out.splitlines()
    assert first == "['VELO_NUMPY']"
    assert second.startswith("VELO ") and "'NIXL'" in second and "'VELO'" in second


def test_ray_registering_velo_first_is_no_error() -> None:
    """Ray's registration task from an actor's creator may register VELO before the hook
    does (or after): either order leaves one registration and no error."""
    out = run(
        "import torch\n"
        "from ray.experimental.rdt.util import register_tensor_transport, transport_manager_info\n"
        "from ray_velo.rdt import VeloTensorTransport, register_transports, worker_setup\n"
        "del transport_manager_info['VELO']  # as if Ray's task had come first\n"
        "register_tensor_transport('VELO', ['cpu', 'cuda'], VeloTensorTransport, torch.Tensor)\n"
        "worker_setup()\n"
        "print(register_transports(), sorted(transport_manager_info))\n"
    )
    assert out.strip() == "[] ['VELO', 'VELO_NUMPY']"


def test_runtime_env_adds_the_hook_and_keeps_the_rest() -> None:
    env = {"env_vars": {"A": "1"}, "pip": ["x"]}
    assert rv.runtime_env(env) == {**env, "worker_process_setup_hook": HOOK}
    assert env == {"env_vars": {"A": "1"}, "pip": ["x"]}  # the caller's dict untouched
    assert rv.runtime_env() == {"worker_process_setup_hook": HOOK}
    assert rv.runtime_env(rv.runtime_env()) == {"worker_process_setup_hook": HOOK}


def test_runtime_env_refuses_a_hook_of_the_jobs_own_unless_told() -> None:
    env = {"worker_process_setup_hook": "mine.setup"}
    with pytest.raises(ValueError, match=r"call ray_velo.worker_setup\(\) from it"):
        rv.runtime_env(env)
    assert rv.runtime_env(env, own_hook=True) == env
