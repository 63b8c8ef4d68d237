"""The tests' nodes that share no disk and the servers they share, all on 127.0.0.1, registered for every test module
(tests/conftest.py's pytest_plugins):

- `s3` (session): moto's S3 server with the bucket tests.helpers.BUCKET, its endpoint in the environment that jobs,
  nodes and the one-node Ray inherit; `digits_on_s3` (session): the digits' shards and eval sets on it.
- `local_cluster` (module): a local autoscaling cluster of ray_cluster.yaml's node types (pipelines.cluster.local), its
  0-CPU head with token auth, worker nodes that the autoscaler starts and stops; `submit` a job to it, read its nodes
  with `nodes`, `alive_workers`, `dashboard`.
- `two_node_ray` (per test): (`Cluster`, dashboard URL): a 0-CPU head (ray.cluster_utils, its session in
  `ray_temp_dir()`) and two isolated 3-CPU worker `Node`s (pipelines.cluster.isolated: a mount namespace each, a private
  /tmp and project state folder; `seen_by` checks it); the test adds and loses nodes (`Cluster.add`, `Cluster.lose`,
  `drain` for a notice first) as an autoscaler would and as machines are lost.
- `mlflow_server` (module): `mlflow server` with its artifacts on S3, as (URI, its folder).
- `restartable_mlflow` (per test): an `MlflowServer` with its artifacts on its own disk, which the test may `stop()`
  and `start()` again on the same port and database (an outage).
- `hanging_store` (per test): a `HangingStore`, a tracking store that accepts every connection and never answers (a
  stuck proxy, a server whose workers are all busy): each request held until the test `release()`s it or ends.
- `proxied_mlflow` (per module) and `proxy_store` (per test): a `ProxyStore`, an HTTP proxy on 127.0.0.1 in front
  of a real MLflow server that passes calls through, answers them itself (a 404 page, a 413, a 502), holds one past
  the client's timeout and then passes it on (the retry is a duplicate), or refuses: what an ingress in front of a
  store that is down answers.
- `http_calls` (per test): every HTTP request this process's MLflow clients make (requests' sessions), with the thread
  that made it: which calls went to the store from the thread that logs, and which from the outbox's.

A new multi-node test is one function in the `cluster` tier (`make test-cluster`: one pytest process, never beside
other Ray work) that asks for what it needs:

    @pytest.mark.cluster
    def test_a_run_outlives_a_lost_node(two_node_ray, restartable_mlflow, digits_on_s3, tmp_path):
        cluster, api = two_node_ray  # a job reaches it with RAY_ADDRESS=cluster.address
        ...  # start the job (tracking.uri=restartable_mlflow.uri); cluster.lose(cluster.nodes[-1]); cluster.add()

Loaded with conftest for every test, even those with no Ray: what imports Ray is imported where it is used.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipelines.cluster import services
from tests.helpers import BUCKET, free_port, wait_for
from tests.pace import scaled

if TYPE_CHECKING:
    from pipelines.cluster.local import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with the bucket BUCKET (tests.helpers); its endpoint and credentials in this
    process's environment while the session runs (jobs and local clusters started by the tests inherit them, as a
    cloud node has its instance role): an s3fs filesystem on it."""
    import s3fs

    port = free_port()
    env = services.s3_env(f"http://127.0.0.1:{port}")
    server = services.start_s3(port, tmp_path_factory.mktemp("s3") / "log", [BUCKET])
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield s3fs.S3FileSystem()
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        services.stop(server)


@pytest.fixture(scope="session")
def digits_on_s3(s3, digits_root) -> str:
    """`digits_root`'s shards and eval sets on the tests' S3, what a cluster's nodes read (none sees the head's copy).
    In one pytest process (`make test-cluster`) they are the files `straight_small_run` trained on."""
    from pipelines.digits.shards import write_digit_eval_sets

    write_digit_eval_sets(digits_root)  # what the digits source adds to its shards (idempotent)
    s3.put(digits_root, f"{BUCKET}/digits", recursive=True)
    return f"s3://{BUCKET}/digits"


class MlflowServer:
    """`mlflow server` on 127.0.0.1: a sqlite store in `folder`, artifacts proxied to `artifacts` (default: a folder
    in `folder`). `stop()` and `start()` again keep its port and database, as a tracking server that goes away and
    comes back."""

    def __init__(self, folder: Path, artifacts: str | None = None):
        self.port, self.folder = free_port(), folder
        self.artifacts = artifacts or str(folder / "artifacts")
        self.uri = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.process = services.start_mlflow(self.port, self.folder, self.artifacts, {})

    def stop(self) -> None:
        services.stop(self.process)


@pytest.fixture(scope="module")
def mlflow_server(s3, tmp_path_factory):
    """`mlflow server` on 127.0.0.1: sqlite backend, artifacts proxied to the S3 store (clients upload through the
    server, which alone needs the store's credentials)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), f"s3://{BUCKET}/mlflow")
    try:
        yield server.uri, server.folder
    finally:
        server.stop()


@pytest.fixture
def restartable_mlflow(tmp_path):
    """An `MlflowServer` of the test's own in tmp_path/mlflow, stopped at its end whatever the test left it in."""
    server = MlflowServer(tmp_path / "mlflow")
    try:
        yield server
    finally:
        server.stop()


class HangingStore:
    """A tracking store that hangs: a TCP server on 127.0.0.1 that accepts every connection, reads its request and
    never answers, holding it until `release()` (or the fixture's end) closes it. A port that refuses at once shows
    only that a failed call is caught; a call to this one returns after the client's timeout, so a caller that tried
    the store, whatever it does with the error, is still waiting. `accepted`: connections accepted; `requests`: the
    first line of each request received, in order."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.uri = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.changed = threading.Condition()
        self.connections: list[socket.socket] = []
        self.accepted = 0
        self.requests: list[str] = []
        threading.Thread(target=self._accept, name="hanging-store", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            with self.changed:
                self.accepted += 1
                self.connections.append(conn)
                self.changed.notify_all()
            threading.Thread(target=self._read, args=(conn,), name="hanging-store-request", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n" not in data:
            try:
                chunk = conn.recv(65536)
            except OSError:  # released
                return
            if not chunk:
                return
            data += chunk
        with self.changed:
            self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
            self.changed.notify_all()

    def wait_requests(self, count: int, timeout_s: float) -> list[str]:
        """The request lines once `count` have arrived (an AssertionError after `timeout_s`, scaled to the machine)."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.requests) >= count, scaled(timeout_s)):
                raise AssertionError(f"{len(self.requests)} requests reached the hanging store, not {count}: "
                                     f"{self.requests}")
            return list(self.requests)

    def held(self) -> int:
        """Connections still open at both ends: accepted, never answered, and not given up by the client."""
        with self.changed:
            connections = list(self.connections)
        open_ = 0
        for conn in connections:
            try:
                open_ += conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""  # b"": the client hung up
            except BlockingIOError:  # nothing to read: open, waiting for an answer
                open_ += 1
            except OSError:  # released
                pass
        return open_

    def release(self) -> None:
        """Every connection held so far closed without an answer (the client's call fails at once)."""
        with self.changed:
            connections, self.connections = self.connections, []
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.listener.close()
        self.release()


@pytest.fixture
def hanging_store():
    """A `HangingStore` of the test's own, closed at its end with everything it holds."""
    store = HangingStore()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def http_calls(monkeypatch) -> list[tuple[threading.Thread, str, str]]:
    """Every HTTP request made in this process while the test runs (MLflow's clients send theirs through requests'
    sessions), as (the thread that made it, method, URL), in order, recorded as each is sent."""
    import requests

    calls: list[tuple[threading.Thread, str, str]] = []
    send = requests.Session.request

    def request(self, method, url, *args, **kwargs):
        calls.append((threading.current_thread(), str(method), str(url)))
        return send(self, method, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", request)
    return calls


@pytest.fixture(scope="module")
def local_cluster(s3, tmp_path_factory):
    from pipelines.cluster.local import start

    # 2 CPUs a node: the training's two workers and Ray Data's tasks on few nodes (each node is a raylet and its agents)
    cluster = start(tmp_path_factory.mktemp("local_cluster"), idle_timeout_minutes=0.1, cpus_per_node=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def dashboard(cluster: LocalCluster, path: str) -> dict:
    """GET `path` of the dashboard's HTTP API, with the token (a request, where the `ray` CLI would start a Python)."""
    with urllib.request.urlopen(cluster.api_request(path), timeout=scaled(30)) as response:
        return json.load(response)


def nodes(cluster: LocalCluster) -> list[dict]:
    """The cluster's nodes from the state API."""
    return dashboard(cluster, "/api/v0/nodes?limit=1000")["data"]["result"]["result"]


def alive_workers(cluster: LocalCluster) -> set[str]:
    return {n["node_id"] for n in nodes(cluster) if n["state"] == "ALIVE" and not n["is_head_node"]}


def train_worker_raylets(cluster: LocalCluster) -> dict[int, str]:
    """raylet pid -> node id, for the nodes whose raylet runs a Ray Train worker (its child process)."""
    from pipelines.cluster.local import processes

    ours = set(cluster.pids())
    table = {pid: (ppid, cmd) for pid, ppid, cmd in processes() if pid in ours}
    raylets = {}
    for pid, (ppid, cmd) in table.items():
        if cmd.startswith("ray::RayTrainWorker") and ppid in table and "--node_id=" in table[ppid][1]:
            raylets[ppid] = table[ppid][1].split("--node_id=")[1].split()[0]
    return raylets


def submit(cluster: LocalCluster, args: list[str], log: Path, *options: str) -> subprocess.Popen:
    """`ray job submit`, the CLI streaming the job's log (without --no-wait it exits 1 if the job fails). No
    --working-dir: the fake nodes share one runtime-env folder, and a removed node's cleanup (lost, or idle) deletes
    the unpacked working dir under the other nodes' processes; the project is installed in the venv every node runs,
    and every path is absolute."""
    return subprocess.Popen([str(BIN / "ray"), "job", "submit", *options, "--", "python", *args],
                            cwd=ROOT, env=cluster.client_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def ray_temp_dir() -> str:
    """The Ray session folder of `two_node_ray`'s head."""
    return f"/tmp/probvlp_el_{os.getpid()}"  # short: Ray's socket paths must fit


class Node:
    """A worker node with `cpus` CPUs: a raylet in a mount namespace of its own (pipelines.cluster.isolated), its
    own process group, so that killing the group is a machine switched off."""

    def __init__(self, gcs_address: str, cpus: float, log: Path):
        from pipelines.cluster.isolated import start_node
        from pipelines.config import PROJECT_ROOT, STATE_DIR

        self.node_id = secrets.token_hex(28)
        self.process = start_node(gcs_address, ["/tmp", str(STATE_DIR)], cpus, {}, {},
                                  [str(PROJECT_ROOT), sys.prefix], self.node_id, "elastic-worker", log)

    def pids(self) -> dict[int, str]:
        """pid -> command line of this node's processes (its raylet, agents and workers)."""
        from pipelines.cluster.local import processes

        table = list(processes())
        ours, grew = {self.process.pid}, True
        while grew:
            more = {pid for pid, ppid, _ in table if ppid in ours} - ours
            ours |= more
            grew = bool(more)
        return {pid: cmd for pid, _, cmd in table if pid in ours}

    def train_workers(self) -> set[int]:
        return {pid for pid, cmd in self.pids().items() if cmd.startswith("ray::RayTrainWorker")}

    def kill(self) -> None:
        """Every process of the node at once (SIGKILL), as when its machine is switched off."""
        from pipelines.cluster.isolated import stop_node

        stop_node(self.process, graceful=False, wait_s=scaled(30), strays=list(self.pids()))


class Cluster:
    """The head and the worker nodes of the test; `add()` a node, `lose(node)` one."""

    def __init__(self, head, folder: Path):
        self.head, self.folder, self.nodes = head, folder, []
        self.address = head.address

    def add(self, cpus: float = 3) -> Node:
        node = Node(self.address, cpus, self.folder / "nodes.log")
        self.nodes.append(node)
        return node

    def lose(self, node: Node) -> None:
        node.kill()
        self.nodes.remove(node)

    def alive(self) -> set[str]:
        return {n["NodeID"] for n in self.head.global_state.node_table() if n["Alive"]}

    def shutdown(self) -> None:
        for node in list(self.nodes):
            self.lose(node)
        self.head.shutdown()


@pytest.fixture
def two_node_ray(s3, tmp_path, monkeypatch):
    """A head with no CPUs (its dashboard on 127.0.0.1) and two isolated 3-CPU worker nodes."""
    from ray.cluster_utils import Cluster as RayCluster

    from pipelines.cluster.runtime import local_port, port_lock

    # Right after a node loss Ray Train still counts the lost node for ~20 s and asks for 2 workers; on a cloud
    # cluster Ray's 60 s wait for them runs out and it asks again for what fits. 10 s here (the job's driver passes
    # it to the Train controller) keeps the test short and leaves a loaded machine time to place the workers of a
    # regrown group.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    temp_dir = ray_temp_dir()
    with port_lock():  # the dashboard's port is taken by the head before another local Ray looks
        dashboard = local_port()
        head = RayCluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.1", "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard, "temp_dir": temp_dir})
    cluster = Cluster(head, tmp_path)
    try:
        nodes = [cluster.add(), cluster.add()]
        wait_for("two worker nodes", lambda: {n.node_id for n in nodes} <= cluster.alive(), 120, 0.5)
        yield cluster, f"http://127.0.0.1:{dashboard}"
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def drain(cluster: Cluster, node_id: str, reason: str, deadline_s: float | None = None) -> None:
    """What Ray's autoscaler does to a node it is about to lose (`ray drain-node` by hand): `reason` PREEMPTION with
    the seconds left (a spot reclaim), or IDLE_TERMINATION (an idle node scaled down). It kills nothing."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2
    from ray.exceptions import RpcError

    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    try:
        accepted, why = GcsClient(address=cluster.address).drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.Value(reason), "tests/multinode.py", deadline_ms)
    except RpcError as error:
        # An idle node that accepts an idle drain exits at once, and the GCS, seeing it gone, can cancel its call to
        # that node before the answer is back ("Cancelling all calls": the elastic run failed so on 2026-12-05 and
        # -06): the node going away is then the acceptance.
        if reason != "DRAIN_NODE_REASON_IDLE_TERMINATION":
            raise
        wait_for(f"the idle node gone after its drain ({error})", lambda: node_id not in cluster.alive(), 60, 0.2)
        return
    assert accepted, why


def seen_by(pid: int, *paths: Path) -> dict[str, bool]:
    """Which of `paths` the process `pid` sees, in its own view of the filesystem (/proc/<pid>/root: its node's, in
    a mount namespace of its own)."""
    return {str(p): os.path.lexists(f"/proc/{pid}/root{p}") for p in paths}


@dataclass
class ProxyRule:
    """What a `ProxyStore` does with a request (kind: "answer", "hold", "forward_then_answer") whose path contains
    `path` and whose body `only` accepts, for the next `times` such requests (None: all of them)."""

    kind: str
    status: int = 200
    body: bytes = b""
    content_type: str = "text/html"
    seconds: float = 0.0
    path: str = ""
    only: Callable[[bytes], bool] | None = None
    times: int | None = None

    def applies(self, path: str, body: bytes) -> bool:
        return self.path in path and (self.only is None or self.only(body))


class ProxyStore:
    """An HTTP proxy on 127.0.0.1 in front of an MLflow server (`upstream`), what an ingress, nginx or an API gateway is
    in front of a tracking store. Its modes, switched by the test: `forward()` passes every request through (the
    start); `answer(status, body, content_type)` answers in the server's stead (an ingress's 404 page while the store
    behind it is down, nginx's 413 over its body limit, a 502); `hold_then_forward(seconds)` keeps a request
    unanswered for `seconds` (past the client's timeout), then passes it on and drops the reply: the server processes
    it late; `forward_then_answer(status, body)` passes it on and answers the client otherwise (the call went through,
    the client is told it did not); `refuse()` resets every connection at once (nothing behind the address).

    A mode may be limited to the requests whose path contains `path` and whose body `only(body)` accepts (the others
    are passed through) and to the next `times` of them; modes so limited queue up, each taking over when the one
    before it is used up, and `forward()` clears them. `counts`: requests received per path (no query); `received`:
    (path, body) of each, in order; `answered`: (method, path, status the client got, or 0 for none) of each, in the
    order they were answered."""

    def __init__(self, upstream: str):
        import http.server
        from urllib.parse import urlsplit

        self.upstream = urlsplit(upstream)
        self.lock = threading.Condition()
        self.rules: list[ProxyRule] = []
        self.refusing = False
        self.counts: dict[str, int] = {}
        self.received: list[tuple[str, bytes]] = []
        self.answered: list[tuple[str, str, int]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request a connection: the client's next call is a new one

            def handle(self):
                if proxy.refusing:  # RST: the client's call fails at once
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                super().handle()

            def log_message(self, *args):
                pass

            def _any(self):
                proxy._serve(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that went away (a held request past its timeout) is what the tests make

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, name="proxy-store", daemon=True).start()

    def uri_with(self, userinfo: str) -> str:
        """The proxy's URI with `userinfo` (user:password, a token) in it."""
        return f"http://{userinfo}@127.0.0.1:{self.port}"

    # --- the modes
    def _set(self, rule: ProxyRule) -> ProxyStore:
        with self.lock:
            self.refusing = False
            if rule.times is None:
                self.rules = [r for r in self.rules if r.times is not None] + [rule]
            else:
                self.rules.append(rule)
        return self

    def forward(self) -> ProxyStore:
        with self.lock:
            self.rules, self.refusing = [], False
        return self

    def answer(self, status: int, body: str | bytes = b"", content_type: str = "text/html", **limits) -> ProxyStore:
        body = body.encode() if isinstance(body, str) else body
        return self._set(ProxyRule("answer", status, body, content_type, **limits))

    def hold_then_forward(self, seconds: float, **limits) -> ProxyStore:
        return self._set(ProxyRule("hold", seconds=seconds, **limits))

    def forward_then_answer(self, status: int, body: str | bytes, content_type: str = "application/json",
                            **limits) -> ProxyStore:
        body = body.encode() if isinstance(body, str) else body
        return self._set(ProxyRule("forward_then_answer", status, body, content_type, **limits))

    def refuse(self) -> ProxyStore:
        with self.lock:
            self.rules, self.refusing = [], True
        return self

    # --- what it saw
    def count(self, part: str) -> int:
        """Requests received so far whose path contains `part`."""
        with self.lock:
            return sum(n for path, n in self.counts.items() if part in path)

    def wait_count(self, part: str, count: int, timeout_s: float) -> None:
        """Until `count` requests whose path contains `part` arrived (an AssertionError after `timeout_s`, scaled)."""
        with self.lock:
            if not self.lock.wait_for(lambda: sum(n for p, n in self.counts.items() if part in p) >= count,
                                      scaled(timeout_s)):
                raise AssertionError(f"not {count} requests to {part} in {timeout_s} s: {self.counts}")

    def wait_settled(self, timeout_s: float) -> None:
        """Until every request received so far was answered or dropped (a held one passed on to the server)."""
        with self.lock:
            if not self.lock.wait_for(lambda: len(self.answered) >= sum(self.counts.values()), scaled(timeout_s)):
                raise AssertionError(f"requests still held after {timeout_s} s: {self.counts}, {self.answered}")

    # --- a request
    def _rule(self, path: str, body: bytes) -> ProxyRule | None:
        with self.lock:
            if not self.rules or not self.rules[0].applies(path, body):
                return None
            rule = self.rules[0]
            if rule.times is not None:
                rule.times -= 1
                if rule.times <= 0:
                    self.rules.pop(0)
            return rule

    @staticmethod
    def _behind_gateway(target: str) -> str:
        """A request through a gateway that takes a token in the URI's query (the tracking URI
        http://127.0.0.1:PORT/gw?token=T: MLflow puts its endpoint after it, /gw?token=T/api/2.0/...&run_id=...) or in
        front of it (artifacts: /gw/api/2.0/mlflow-artifacts/...), as the store behind it is asked."""
        if target.startswith("/gw?token="):
            rest = target[len("/gw?token="):].partition("/")[2]
            endpoint, _, query = rest.partition("&")
            return f"/{endpoint}" + (f"?{query}" if query else "")
        return target[len("/gw"):] if target.startswith("/gw/") else target

    def _serve(self, handler) -> None:
        target = self._behind_gateway(handler.path)
        path = target.split("?", 1)[0]
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() not in ("host", "connection", "keep-alive", "transfer-encoding", "content-length")}
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while (size := int(handler.rfile.readline().split(b";")[0], 16)):
                body += handler.rfile.read(size)
                handler.rfile.readline()
            handler.rfile.readline()
        else:
            body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        with self.lock:
            self.counts[path] = self.counts.get(path, 0) + 1
            self.received.append((path, body))
            self.lock.notify_all()
        rule = self._rule(path, body)
        status, reply, content_type = 0, b"", "text/plain"
        if rule is None or rule.kind != "answer":
            if rule is not None and rule.kind == "hold":
                time.sleep(rule.seconds)  # the client gave up meanwhile; the server gets the call now
            status, reply, content_type = self._forward(handler.command, target, headers, body)
        if rule is not None and rule.kind in ("answer", "forward_then_answer"):
            status, reply, content_type = rule.status, rule.body, rule.content_type
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(reply)))
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(reply)
            handler.wfile.flush()
        except OSError:  # the client went away (its timeout): the reply is dropped
            status = 0
        with self.lock:
            self.answered.append((handler.command, path, status))
            self.lock.notify_all()

    def _forward(self, method: str, target: str, headers: dict, body: bytes) -> tuple[int, bytes, str]:
        import http.client

        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=scaled(60))
        try:
            conn.request(method, target, body=body, headers={**headers, "Content-Length": str(len(body))})
            response = conn.getresponse()
            return response.status, response.read(), response.getheader("Content-Type", "application/octet-stream")
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def proxied_mlflow(tmp_path_factory):
    """An `MlflowServer` (artifacts on its own disk) for the `proxy_store`s of a module's tests: each test makes its
    own runs in it."""
    server = MlflowServer(tmp_path_factory.mktemp("proxied_mlflow"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy_store(proxied_mlflow):
    """A `ProxyStore` of the test's own in front of `proxied_mlflow`, passing everything through until the test
    switches it; closed at the test's end."""
    proxy = ProxyStore(proxied_mlflow.uri)
    try:
        yield proxy
    finally:
        proxy.close()
