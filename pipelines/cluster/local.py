"""An autoscaling Ray cluster on this machine, made from `ray_cluster.yaml`'s node types, whose nodes share no disk.

Ray's autoscaler runs for real over the fake multi-node provider's logic: each node it launches is a raylet on this
machine with its node type's resources, in a mount namespace of its own (`pipelines.cluster.isolated`: its own /tmp
and project data folder), and idle nodes go away after `idle_timeout_minutes`. The config is derived from
ray_cluster.yaml by `local_config` (same worker node types, their CPUs scaled down, GPUs dropped since this machine
has none), so what runs here is what the cloud cluster would launch. Everything binds 127.0.0.1 and the jobs API
needs Ray's token. `up` also starts what the nodes share (`pipelines.cluster.services`): an S3-protocol store and an
`mlflow server` with its artifacts there, and prints the environment to export.

    python -m pipelines.cluster.local up      # (make cluster-up) prints RAY_ADDRESS and the services' environment
    python -m pipelines.cluster.local down    # (make cluster-down)
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from pipelines.config import PROJECT_ROOT, STATE_DIR, ConfigError
from pipelines.cluster import services
from pipelines.cluster.isolated import PROVIDER
from pipelines.cluster.runtime import local_port, port_lock

CLUSTER_YAML = PROJECT_ROOT / "ray_cluster.yaml"
# `up`'s cluster: its state file, config, logs and services
CLUSTER_DIR = STATE_DIR / "local_cluster"
# The fake provider registers its head under this node type name, whatever the config calls it.
FAKE_HEAD_TYPE = "ray.head.default"
# Accelerators a CPU-only machine cannot offer: a job asking for them gets the driver's clear error
# (pipelines.cluster.check), not a node that pretends to have one.
DROPPED = ("GPU", "TPU", "neuron_cores")

# Local only: the autoscaler acts every second (Ray's default, 5 s, suits cloud machines that take minutes to boot).
# Ray's health-check defaults stay: shorter ones mark live nodes dead when the machine is loaded.
_FAST_ENV = {"AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def local_config(source: Path = CLUSTER_YAML, *, gcs_port: int, cpus_per_node: float | dict[str, float] = 1,
                 max_nodes_per_type: int = 2, idle_timeout_minutes: float = 0.1) -> dict:
    """The autoscaling config of `source` for the fake provider: every worker node type keeps its name,
    min_workers and custom resources, gets `cpus_per_node` logical CPUs (a number, or one per type) and at
    most `max_nodes_per_type` nodes; accelerators are dropped. A node type that could not hold one 1-CPU
    worker is a ConfigError."""
    cloud = yaml.safe_load(Path(source).read_text())
    types = {}
    for name, node in cloud["available_node_types"].items():
        if name == cloud["head_node_type"]:
            continue
        cpus = cpus_per_node.get(name, 1) if isinstance(cpus_per_node, dict) else cpus_per_node
        if cpus < 1:
            raise ConfigError(f"local cluster: node type {name!r} with {cpus:g} CPU cannot hold one worker (1 CPU)")
        resources = {k: v for k, v in (node.get("resources") or {}).items() if k not in DROPPED}
        types[name] = {"resources": {**resources, "CPU": cpus}, "node_config": {},
                       "min_workers": node.get("min_workers", 0),
                       "max_workers": min(node.get("max_workers", max_nodes_per_type), max_nodes_per_type)}
    head = cloud["available_node_types"][cloud["head_node_type"]]
    types[FAKE_HEAD_TYPE] = {"resources": dict(head.get("resources") or {"CPU": 0}), "node_config": {},
                             "max_workers": 0}
    return {
        "cluster_name": f"{cloud['cluster_name']}-local",
        "max_workers": sum(t["max_workers"] for t in types.values()),
        "upscaling_speed": cloud.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle_timeout_minutes,
        # gcs_address: without it the provider starts workers against 127.0.0.1:6379, where nothing listens.
        # No updaters: the fake provider's nodes are started as they are and it refuses the updaters' tags.
        # use_node_id_as_ip: every node here is 127.0.0.1; the provider names its nodes by node id instead.
        # Every worker node in a mount namespace of its own (pipelines.cluster.isolated): its own empty /tmp and
        # project data folder, so a file written on one node is absent on the others, as on a cloud cluster.
        "provider": {"type": "external", "module": PROVIDER, "gcs_address": f"127.0.0.1:{gcs_port}",
                     "hidden_paths": [str(STATE_DIR)], "keep_paths": [str(PROJECT_ROOT), sys.prefix],
                     "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": types,
        "head_node_type": FAKE_HEAD_TYPE,
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@dataclass
class LocalCluster:
    """A running local cluster: where to submit jobs, and what a client needs in its environment."""

    address: str  # the dashboard / jobs API (RAY_ADDRESS for `ray job submit`)
    gcs_address: str  # for ray.init(address=...) from this machine
    temp_dir: str  # every process of this cluster carries it on its command line
    token_path: str

    def client_env(self) -> dict[str, str]:
        """Environment for `ray job submit`, `ray list` and drivers (token auth on)."""
        env = {**os.environ, "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN_PATH": self.token_path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("RAY_AUTH_TOKEN", None)
        return env

    def api_request(self, path: str) -> urllib.request.Request:
        """A request to `path` of the head's HTTP API (jobs, state), carrying the cluster's token."""
        return urllib.request.Request(f"{self.address}{path}",
                                      headers={"Authorization": f"Bearer {Path(self.token_path).read_text()}"})

    def pids(self) -> list[int]:
        """This cluster's processes: those naming its temp folder or GCS (head, autoscaler, the fake nodes'
        raylets) and their descendants (workers and agents, which rename themselves)."""
        table = list(processes())
        ours = {pid for pid, _, cmd in table if self.temp_dir in cmd or f"{self.gcs_address} " in cmd}
        grew = True
        while grew:
            more = {pid for pid, ppid, _ in table if ppid in ours} - ours
            ours |= more
            grew = bool(more)
        return sorted(ours)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop this cluster's processes by pid: never `ray stop`, which would stop every Ray on the machine."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)


def processes():
    """(pid, parent pid, command line + " ") of this machine's processes, from /proc (Linux)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            yield int(entry.name), ppid, cmd + " "


def start(folder: Path, config: dict | None = None, timeout_s: float = 180, **config_options) -> LocalCluster:
    """Start a head (0 CPUs, as ray_cluster.yaml's) with the autoscaler on `config` (default: local_config
    of ray_cluster.yaml with `config_options`). `folder` keeps the config, the token and the head's log."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    token_path = folder / "auth_token"
    if not token_path.exists():
        token_path.write_text(secrets.token_hex(16))
        token_path.chmod(0o600)
    temp_dir = f"/tmp/probvlp_lc_{secrets.token_hex(3)}"  # short: Ray's socket paths must fit
    # Every port explicit and free: other Ray instances on this machine hold the defaults.
    with port_lock():
        gcs, dash, agent, client = local_port(), local_port(8265), local_port(), local_port()
        config = config or local_config(gcs_port=gcs, **config_options)
        config["provider"]["gcs_address"] = f"127.0.0.1:{gcs}"
        config["provider"].setdefault("log_dir", str(folder / "nodes"))
        (folder / "cluster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        head_cpus = config["available_node_types"][config["head_node_type"]]["resources"].get("CPU", 0)
        cluster = LocalCluster(f"http://127.0.0.1:{dash}", f"127.0.0.1:{gcs}", temp_dir, str(token_path))
        # RAY_API_SERVER_ADDRESS: this cluster's state API for every process it starts (Ray Train's placement-group
        # cleaner calls it), which would otherwise refuse to choose among this machine's several Ray instances.
        env = {**cluster.client_env(), "RAY_FAKE_CLUSTER": "1", "RAY_API_SERVER_ADDRESS": cluster.address, **_FAST_ENV}
        env.pop("RAY_ADDRESS")
        with (folder / "head.log").open("w") as log:
            subprocess.run(
                [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--autoscaling-config={folder / 'cluster.yaml'}",
                 f"--num-cpus={head_cpus:g}", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
                 f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                # in the project folder: a job submitted without --working-dir runs there (relative paths as locally)
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, check=True, timeout=timeout_s,
            )
    _wait_jobs_api(cluster, timeout_s)
    return cluster


def _wait_jobs_api(cluster: LocalCluster, timeout_s: float) -> None:
    """The jobs API answers (with the token) once the head's job agent is up, a little after `ray start` returns."""
    request = cluster.api_request("/api/jobs/")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(request, timeout=5)
            return
        except OSError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the local cluster's jobs API at {cluster.address} did not answer: {err}")
            time.sleep(1)


def _up(args) -> int:
    state = CLUSTER_DIR / "state.json"
    if state.exists():
        print(f"a local cluster is already up ({state}); `make cluster-down` first", file=sys.stderr)
        return 1
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    # The services every node reaches (as a cloud cluster's S3 and tracking server), then the cluster, whose
    # nodes inherit their environment.
    with port_lock():
        s3_port, mlflow_port = local_port(), local_port()
    env = services.s3_env(f"http://127.0.0.1:{s3_port}")
    s3 = services.start_s3(s3_port, CLUSTER_DIR / "s3.log", [args.bucket])
    tracking = services.start_mlflow(mlflow_port, CLUSTER_DIR / "mlflow", f"s3://{args.bucket}/mlflow", env)
    env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{mlflow_port}"
    os.environ.update(env)
    cluster = start(CLUSTER_DIR, idle_timeout_minutes=args.idle_timeout_minutes,
                    max_nodes_per_type=args.max_nodes_per_type, cpus_per_node=args.cpus_per_node)
    state.write_text(json.dumps({**asdict(cluster), "services": [s3.pid, tracking.pid]}))
    print(f"local autoscaling cluster up: head at {cluster.address} (0 CPUs), node types of {CLUSTER_YAML.name}, each "
          f"node with its own disk; config {CLUSTER_DIR / 'cluster.yaml'}")
    print(f"object store: s3://{args.bucket} at {env['AWS_ENDPOINT_URL']}; MLflow server {env['MLFLOW_TRACKING_URI']} "
          f"(artifacts on s3://{args.bucket}/mlflow)")
    print(f"export RAY_ADDRESS={cluster.address} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path} "
          + " ".join(f"{k}={v}" for k, v in env.items()))
    return 0


def _down(_args) -> int:
    state = CLUSTER_DIR / "state.json"
    if not state.exists():
        print("no local cluster is up")
        return 0
    saved = json.loads(state.read_text())
    pids = saved.pop("services", [])
    LocalCluster(**saved).stop()
    for pid in pids:
        services.stop(pid)
    state.unlink()
    print("local cluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.cluster.local", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the head; worker nodes come and go with the jobs' demand")
    up.add_argument("--idle-timeout-minutes", type=float, default=0.25)
    up.add_argument("--max-nodes-per-type", type=int, default=2)
    up.add_argument("--cpus-per-node", type=float, default=1)
    up.add_argument("--bucket", default="probvlp", help="the object store's bucket (created)")
    sub.add_parser("down", help="stop the cluster started by `up`")
    args = parser.parse_args(argv)
    try:
        return _up(args) if args.command == "up" else _down(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
