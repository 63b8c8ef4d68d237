"""A local Ray beside another Ray instance on the same machine (two runs on one workstation, or pytest workers)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOLD = "from pipelines.ray_env import init_ray; import sys; init_ray(num_cpus=1); print('up', flush=True); sys.stdin.read()"


def test_state_api_finds_its_own_instance_beside_another(ray_local):
    """Ray Train's placement-group cleaner asks Ray's state API whether the controller lives; with a second
    instance on the machine, the API's own lookup refuses ("Found multiple active Ray instances")."""
    other = subprocess.Popen([sys.executable, "-c", HOLD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "up"

        @ray_local.remote
        class Probe:
            def ping(self) -> int:
                return 1

        @ray_local.remote
        def alive(actor_id: str) -> bool:
            from ray.train.v2._internal.state.util import is_actor_alive

            return is_actor_alive(actor_id, timeout=30)

        probe = Probe.remote()
        ray_local.get(probe.ping.remote())
        assert ray_local.get(alive.remote(probe._actor_id.hex())) is True
    finally:
        other.stdin.close()
        other.wait(timeout=60)
