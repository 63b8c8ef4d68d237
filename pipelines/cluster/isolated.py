"""Nodes that share no disk, on one machine: the local cluster's worker nodes each run in a mount namespace of their
own (`unshare -m`), with a private, empty `/tmp` and an empty project data folder (`.probvlp`) over the head's.

On a cloud cluster a node sees only its own disk: a file the job's driver writes on the head (the bundled digits, a
sqlite MLflow store, a local checkpoint folder) is not there for a training worker. Nodes started by Ray's fake
multi-node provider run on the machine's one filesystem, where such a file is silently visible to every node, so a
test on them cannot see that mistake. Here each node is `ray start --block` inside its own mount namespace; its
network, the installed packages and the project's code stay shared (a node image has them; `--working-dir` ships a
job's own copy per node). The autoscaler drives these nodes as it drives the fake provider's (same node ids, types
and resources), so autoscaling, node loss and replacement behave as there.

Linux only, and it needs the right to create mount namespaces (root, as on the machines this project is tested on).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from pipelines.cluster.runtime import local_port
from pipelines.compat.ray_private import fake_multi_node_provider, start_worker_node
from ray.autoscaler.tags import (NODE_KIND_WORKER, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME,
                                 TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE)

PROVIDER = f"{__name__}.IsolatedNodeProvider"


def node_command(gcs_address: str, hidden: list[str], num_cpus: float, resources: dict, labels: dict,
                 keep: list[str] = ()) -> list[str]:
    """This module's `node` entry point joining `gcs_address`, in a new mount namespace where each of `hidden` is an
    empty tmpfs, except the folders of `keep` inside them (the project and its Python, e.g. a checkout under /tmp),
    which stay as they are, as a node image would have them."""
    q = shlex.quote
    kept = [k for k in keep if any(k != h and k.startswith(h.rstrip("/") + "/") for h in hidden)
            and not any(k != o and k.startswith(o.rstrip("/") + "/") for o in keep)]
    mounts = [f"mkdir -p /run/probvlp-keep/{i} && mount --bind {q(k)} /run/probvlp-keep/{i}" for i, k in enumerate(kept)]
    # the project's data folder lies inside the kept project: hidden after the project is put back
    covered = [h for h in hidden if not any(h.startswith(k.rstrip("/") + "/") for k in kept)]
    inside = [h for h in hidden if h not in covered]
    mounts += [f"mkdir -p {q(p)} && mount -t tmpfs -o mode=1777 probvlp-node {q(p)}" for p in covered]
    mounts += [f"mkdir -p {q(k)} && mount --bind /run/probvlp-keep/{i} {q(k)}" for i, k in enumerate(kept)]
    mounts += [f"mkdir -p {q(p)} && mount -t tmpfs -o mode=1777 probvlp-node {q(p)}" for p in inside]
    node = shlex.join([sys.executable, "-m", __name__, gcs_address, f"{num_cpus:g}", json.dumps(resources),
                       json.dumps(labels)])
    # --propagation private: the node's mounts stay in its namespace (the head and the other nodes never see them)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join([*mounts, f"exec {node}"])]


def node_env(node_id: str, node_type: str) -> dict[str, str]:
    """The node's environment: the head's, its id and type as the autoscaler names them, and the cluster's token by
    value (the token file lies in a folder the node does not see)."""
    env = {**os.environ, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id, "RAY_CLOUD_INSTANCE_ID": node_id,
           "RAY_NODE_TYPE_NAME": node_type}
    # How long the node's raylet waits for its agents (run_node): Ray's 30 s is short for a Python process's imports
    # on a loaded 2-core machine; a node that would come up late is better than one that dies.
    env.setdefault("RAY_agent_register_timeout_ms", "300000")
    token_path = env.pop("RAY_AUTH_TOKEN_PATH", None)
    if token_path and "RAY_AUTH_TOKEN" not in env:
        env["RAY_AUTH_TOKEN"] = Path(token_path).read_text().strip()
    return env


def start_node(gcs_address: str, hidden: list[str], num_cpus: float, resources: dict, labels: dict, keep: list[str],
               node_id: str, node_type: str, log: Path) -> subprocess.Popen:
    """A worker node joining `gcs_address` (node_command, node_env), its output appended to `log`, in a process group
    of its own: stop_node ends it as a whole, like a machine switched off."""
    with log.open("ab") as out:
        return subprocess.Popen(node_command(gcs_address, hidden, num_cpus, resources, labels, keep),
                                env=node_env(node_id, node_type), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop_node(process: subprocess.Popen, graceful: bool = True, wait_s: float = 10, strays: list[int] = ()) -> None:
    """End a node started by start_node: its process group SIGTERMed (the raylet stops its workers) and SIGKILLed if
    still there after `wait_s`, or (graceful=False) SIGKILLed at once, as when its machine is switched off. `strays`:
    processes of the node that left its group, killed with it."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        for pid in strays:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def free_ports(n: int) -> list[int]:
    """n different free ports of 127.0.0.1, outside the range outgoing connections take theirs from (local_port)."""
    ports: list[int] = []
    while len(ports) < n:
        port = local_port()
        if port not in ports:
            ports.append(port)
    return ports


def run_node(gcs_address: str, num_cpus: float, resources: dict, labels: dict) -> None:
    """A worker node's raylet and agents (what `ray start --address` starts, as Ray's fake provider starts them:
    `ray start` would turn a loopback GCS address into this machine's external one), until this process is ended."""
    # The agents' ports are chosen here, not by the agents. Given none, the raylet waits for each agent to write its
    # port to a file, a fixed window in Ray 2.60 (RAY_agent_register_timeout_ms does not reach it), and aborts past it:
    # every node the autoscaler started on a loaded 2-core machine died so. Given ports, the raylet starts at once and
    # its clients wait for the agents under Ray's configurable timeout. Ray passes the raylet three of the four; the
    # dashboard agent's listen port it leaves for the raylet to wait on, so that flag is added to the raylet's command.
    ports = dict(zip(("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
                      "runtime_env_agent_port"), free_ports(4)))
    stop_processes = start_worker_node(gcs_address, num_cpus, resources, labels, ports, temp_dir="/tmp/ray")

    def stop(*_):
        stop_processes()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        signal.pause()


class IsolatedNodeProvider(fake_multi_node_provider()):
    """Ray's fake multi-node provider with every worker node in its own mount namespace (module docstring).

    provider config: `gcs_address` (the head's), `hidden_paths` (folders each node gets empty; `/tmp` always) and
    `log_dir` (each node's `ray start` output, written by this process, so readable from the head)."""

    def __init__(self, provider_config, cluster_name):
        super().__init__(provider_config, cluster_name)
        self._hidden = ["/tmp", *provider_config.get("hidden_paths", [])]
        self._log_dir = Path(provider_config.get("log_dir") or "/tmp")
        self._keep = [os.path.realpath(p) for p in provider_config.get("keep_paths", [])]

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        resources = dict(resources)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            node_id = self._next_hex_node_id()
            num_cpus = resources.pop("CPU", 0)
            for key in ("GPU", "object_store_memory", "memory"):
                resources.pop(key, None)  # none on this machine; memory Ray measures
            self._log_dir.mkdir(parents=True, exist_ok=True)
            process = start_node(self._gcs_address, self._hidden, num_cpus, resources, labels or {}, self._keep,
                                 node_id, node_type, self._log_dir / f"node-{node_id[-5:]}.log")
            self._nodes[node_id] = {
                "tags": {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type,
                         TAG_RAY_NODE_NAME: node_id, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE, **tags},
                "process": process,
            }

    def non_terminated_nodes(self, tag_filters):
        # A node whose process has ended (its raylet failed to start, on a loaded machine) is gone, as a cloud
        # instance that died would be: left listed, the autoscaler waits on it as a pending launch and never
        # starts another for the demand it was to meet.
        with self.lock:
            for node_id, node in list(self._nodes.items()):
                if "process" in node and node["process"].poll() is not None:
                    self._terminate_node(self._nodes.pop(node_id))  # whatever of its process group is left
        return super().non_terminated_nodes(tag_filters)

    def terminate_node(self, node_id):
        with self.lock:
            if node_id in self._nodes:  # not one dropped above since the autoscaler listed it
                super().terminate_node(node_id)

    def _terminate_node(self, node):
        stop_node(node["process"])


if __name__ == "__main__":
    run_node(sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))
