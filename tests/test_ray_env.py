"""A local Ray beside another Ray instance on the same machine (two runs on one workstation, or pytest workers); its
workers keep the project's local state folder of the process that started it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
HOLD = ("import sys; from pipelines.cluster.runtime import init_ray; from pipelines.compat.ray_private import "
        "dashboard_url; init_ray(num_cpus=1, dashboard_port={port}); print(dashboard_url(), flush=True); "
        "sys.stdin.read()")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_state_api_finds_its_own_instance_beside_others(ray_local):
    """Ray Train's placement-group cleaner asks Ray's state API whether the controller lives; with a second
    instance on the machine, the API's own lookup refuses ("Found multiple active Ray instances").
    The two others start at the same moment and prefer the same free dashboard port: one gets it, the other
    a port of its own (both finding the port free, then both binding it, failed one of them)."""
    port = _free_port()
    others = [subprocess.Popen([sys.executable, "-c", HOLD.format(port=port)], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        urls = [other.stdout.readline().strip() for other in others]
        assert f"127.0.0.1:{port}" in urls and len(set(urls)) == 2 and all(u.startswith("127.0.0.1:") for u in urls)

        @ray_local.remote
        class Probe:
            def ping(self) -> int:
                return 1

        @ray_local.remote
        def alive(actor_id: str) -> bool:
            from pipelines.compat.ray_private import train_actor_alive

            return train_actor_alive(actor_id, timeout=scaled(30))

        probe = Probe.remote()
        ray_local.get(probe.ping.remote())
        assert ray_local.get(alive.remote(probe._actor_id.hex())) is True
    finally:
        for other in others:
            other.stdin.close()
            other.wait(timeout=scaled(60))


def test_ray_workers_keep_the_local_state_folder(ray_local):
    """A Ray worker (a training worker writing rank 0's tracking outbox or an injected failure's marker) finds the
    project's local state where the process that started Ray does: $PROBVLP_HOME, inherited (tests/conftest.py sets
    it to the pytest run's own folder, never the checkout's .probvlp)."""
    @ray_local.remote
    def local_dir() -> str:
        from pipelines.config import STATE_DIR

        return str(STATE_DIR)

    assert ray_local.get(local_dir.remote()) == os.environ["PROBVLP_HOME"]
