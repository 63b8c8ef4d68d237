"""Every private Ray name the product (and its tests of Ray's behaviour) uses, each behind a function. Tested with the
Ray pinned in constraints.txt; tests/test_compat.py resolves every name of PRIVATE_NAMES and runs `problems()`.

Imports are inside the functions: this module is imported by Ray Data's logging set-up in every Ray process
(pipelines/cluster/ray_data_logging.yaml) and by a training worker's first imports, which must stay light.
"""
from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path

from pipelines.compat import Shortfalls, unresolved, warn_once

log = logging.getLogger(__name__)

_CONTEXT = "ray.train.v2._internal.execution.context"
_PREEMPTION = "ray.train.v2._internal.execution.preemption"
# Every private name below, as "module:attribute.chain"; `from module import attribute` in this file names no other.
PRIVATE_NAMES = (
    f"{_CONTEXT}:get_train_context",
    f"{_CONTEXT}:TrainContext.get_world_rank",
    f"{_CONTEXT}:logger",
    f"{_PREEMPTION}:merge_preemption_info",
    f"{_PREEMPTION}:PreemptionContext",
    "ray.train.v2._internal.constants:DEFAULT_PREEMPTION_DEADLINE_S",
    "ray.train.v2._internal.state.util:is_actor_alive",
    "ray._private.worker:global_worker",
    "ray._private.worker:connect",
    "ray._private.worker:get_dashboard_url",
    "ray._raylet:GcsClient",
    "ray._raylet:InnerGcsClient.drain_node",
    "ray.core.generated.autoscaler_pb2:DrainNodeReason",
    "ray.core.generated.autoscaler_pb2:ClusterConfig",
    "ray.core.generated.autoscaler_pb2:NodeGroupConfig",
    "ray._private.state:state.get_cluster_config",
    "ray._common.constants:HEAD_NODE_RESOURCE_NAME",
    "ray._private.ray_constants:ENABLE_RAY_CLUSTER",
    "ray._private.ray_constants:PROCESS_TYPE_RAYLET",
    "ray._private.services:start_ray_process",
    "ray._private.parameter:RayParams",
    "ray._private.node:Node",
    "ray._private.node:Node.kill_all_processes",
    "ray.autoscaler._private.fake_multi_node.node_provider:FakeMultiNodeProvider",
    "ray.autoscaler._private.util:prepare_config",
    "ray.autoscaler._private.util:validate_config",
    "ray.autoscaler._private.providers:_get_node_provider_cls",
    "ray.data._internal.logging:SessionFileHandler",
    "ray.data._internal.logging:HiddenRecordFilter",
    "ray._private.log:PlainRayHandler",
    "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._create_default_callbacks",
    "ray.train.v2._internal.callbacks.datasets:DatasetsCallback",
)


# --- Notices of preemption (pipelines.fit.preemption) -------------------------------------------------------------

def _train_context():
    """Ray Train's internal context of this worker; None outside a Ray Train (v2) worker. Public alternative missing:
    `ray.train.get_context()` exposes neither the preemption context nor a way to tell "not a worker" apart."""
    from ray.train.v2._internal.execution.context import get_train_context

    try:
        return get_train_context()
    except RuntimeError as err:
        if "not been initialized" in str(err):  # Ray's words for "no train context in this process"
            return None
        raise


def worker_preemption_info():
    """This worker's `ray.train.PreemptionInfo` as Ray Train's preemption watcher set it (None: no notice, or not in a
    Ray Train worker), read without a collective. Public alternative missing: `ray.train.get_preemption_info()` is a
    barrier across ranks (rank 0's answer broadcast), where the step's all-reduce already carries the flag. Never
    raises: it runs every step; a failure is logged once and read as no notice."""
    try:
        context = _train_context()
        return None if context is None else context.preemption_context.preemption_info
    except Exception as err:
        warn_once(log, "reading Ray Train's notice of preemption", err)
        return None


def set_worker_preemption_info(node_id: str, rank: int | None = None, deadline_ms: int | None = None):
    """Merge a notice Ray did not see (node `node_id` goes, taking `rank`, None: this worker's, by `deadline_ms`, epoch
    milliseconds or None) into this worker's train context, where Ray Train's controller polls it and restarts the run
    at the deadline counting a preemption. Returns the merged PreemptionInfo; None outside a Ray Train worker. Public
    alternative missing: Ray Train learns of preemptions only from its own watcher of node drains."""
    context = _train_context()
    if context is None:
        return None
    from ray.train import PreemptionInfo
    from ray.train.v2._internal.execution.preemption import merge_preemption_info

    info = PreemptionInfo(deadline_ms=deadline_ms,
                          preempted_node_to_ranks={node_id: [context.get_world_rank() if rank is None else rank]})
    known = context.preemption_context.preemption_info
    merged = info if known is None else merge_preemption_info(known, info)
    context.preemption_context.preemption_info = merged
    return merged


def default_preemption_deadline_s() -> float:
    """How long Ray Train's controller waits on a notice without a deadline before it restarts the run. Public
    alternative missing: the constant is not exported."""
    from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S

    return float(DEFAULT_PREEMPTION_DEADLINE_S)


def drain_node(node_id: str, reason: str, message: str, deadline_ms: int | None = None,
               gcs_address: str | None = None) -> tuple[bool, str]:
    """Ask the GCS to drain node `node_id` (hex) with `reason` (PREEMPTION, IDLE_TERMINATION, or the enum's full
    name), as Ray's autoscaler does; it kills nothing. Through this process's Ray connection, or the GCS at
    `gcs_address`. Returns (accepted, why not). Public alternative missing: only the hidden `ray drain-node` CLI."""
    from ray.core.generated.autoscaler_pb2 import DrainNodeReason

    if not reason.startswith("DRAIN_NODE_REASON_"):
        reason = f"DRAIN_NODE_REASON_{reason}"
    if gcs_address is None:
        from ray._private.worker import global_worker

        client = global_worker.gcs_client
    else:
        from ray._raylet import GcsClient

        client = GcsClient(address=gcs_address)
    accepted, why = client.drain_node(node_id, DrainNodeReason.Value(reason), message, deadline_ms or 0)
    return bool(accepted), why.decode() if isinstance(why, bytes) else str(why)


def drain_node_for_preemption(node_id: str, message: str, deadline_ms: int | None = None,
                              gcs_address: str | None = None) -> tuple[bool, str]:
    """`drain_node` with reason PREEMPTION: no worker is placed on the node again and its actors dying count as
    preempted. Public alternative missing: as drain_node."""
    return drain_node(node_id, "PREEMPTION", message, deadline_ms, gcs_address)


def head_node_ids() -> list[str]:
    """The ids of the cluster's live head nodes (one), read from `ray.nodes()` by the resource Ray gives the head.
    Public alternative missing: `ray.nodes()` has no head flag and `ray.util.state` needs the dashboard."""
    import ray
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD_NODE_RESOURCE_NAME in n.get("Resources", {})]


# --- A run's actors (pipelines.fit.trainer) -------------------------------------------------------------------------

@functools.cache
def without_idle_dataset_manager(trainer_cls: type) -> type:
    """`trainer_cls` (TorchTrainer) whose runs start no DatasetManager actor when they are given no Ray dataset (the
    workers read every set themselves: data.reader auto on small sets). Ray Train starts one for each attempt whatever
    its datasets (~2 CPU-s of a process importing Ray and Ray Data, a restart's start-up longer by as much); with no
    dataset it has nothing to split and `ray.train.get_dataset_shard` has nothing to give. Public alternative missing:
    the trainer's default callbacks are fixed in `DataParallelTrainer._create_default_callbacks`."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    class Trainer(trainer_cls):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    Trainer.__name__ = Trainer.__qualname__ = trainer_cls.__name__  # Ray's messages name the trainer as the user's
    return Trainer


# --- The cluster (pipelines.cluster) ---------------------------------------------------------------------------------

def autoscaler_node_groups() -> list[dict] | None:
    """The node groups the autoscaler reported to the GCS (autoscaler v2), each {name, resources, max_count}; None
    when none reported a config. Public alternative missing: the GCS's cluster config is read by Ray's own code only."""
    from ray._private.state import state

    config = state.get_cluster_config()
    if not config:
        return None
    return [{"name": g.name, "resources": dict(g.resources), "max_count": g.max_count}
            for g in config.node_group_configs]


def disable_cluster_mode_in_this_process() -> None:
    """Make this process's already-imported Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (a local Ray's node address,
    and so torch's MASTER_ADDR, stay 127.0.0.1). Public alternative missing: Ray reads the variable once, at import."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def train_report_logger_name() -> str:
    """The name of the logger by which Ray Train logs every `ray.train.report` at INFO (its module's file path), found
    without importing that module (seconds in every Ray worker). Public alternative missing: no setting quietens it."""
    import ray

    return str(Path(ray.__file__).parent.joinpath(*_CONTEXT.split(".")[1:])) + ".py"


def fake_multi_node_provider():
    """Ray's fake multi-node node provider class (every node a raylet on this machine), which the isolated local
    cluster's provider extends. Public alternative missing: only ray.cluster_utils' test helpers, without
    autoscaling."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

    return FakeMultiNodeProvider


def start_worker_node(gcs_address: str, num_cpus: float, resources: dict, labels: dict, ports: dict,
                      temp_dir: str = "/tmp/ray"):
    """A worker node's raylet and agents joined to `gcs_address`, started from this process on 127.0.0.1 (what
    `ray start --address` starts, which would turn a loopback GCS address into the machine's external one), its four
    agent ports (metrics_agent_port, metrics_export_port, dashboard_agent_listen_port, runtime_env_agent_port) given,
    the dashboard agent's listen port passed to the raylet too (Ray 2.60 leaves it out and makes the raylet wait
    for it in a fixed window). Returns a function that stops the node's processes. Public alternative missing:
    `ray start` keeps no loopback address and takes no agent ports."""
    from ray._private import ray_constants, services
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    start_process = services.start_ray_process

    def start_raylet_with_ports(command, process_type, *args, **kwargs):
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = [*command, f"--dashboard_agent_listen_port={ports['dashboard_agent_listen_port']}"]
        return start_process(command, process_type, *args, **kwargs)

    services.start_ray_process = start_raylet_with_ports
    params = RayParams(gcs_address=gcs_address, redis_address=gcs_address, node_ip_address="127.0.0.1",
                       num_cpus=num_cpus, resources=resources, labels=labels, min_worker_port=0, max_worker_port=0,
                       temp_dir=temp_dir, **ports)
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)

    def stop() -> None:
        node.kill_all_processes(check_alive=False, allow_graceful=True)

    return stop


# --- Ray Data's logging (pipelines/cluster/ray_data_logging.yaml names these factories) -------------------------------

def ray_data_file_handler(**kwargs) -> logging.Handler:
    """Ray Data's handler writing to the session's logs/ray-data/ folder. Public alternative missing: Ray Data's logging
    config can only be replaced as a whole, and its file handler is not exported."""
    from ray.data._internal.logging import SessionFileHandler

    return SessionFileHandler(**kwargs)


def ray_data_console_filter():
    """Ray Data's filter of records marked hide-from-console. Public alternative missing: as ray_data_file_handler."""
    from ray.data._internal.logging import HiddenRecordFilter

    return HiddenRecordFilter()


def ray_console_handler(**kwargs) -> logging.Handler:
    """Ray's plain console handler (Ray Data's default console). Public alternative missing: as
    ray_data_file_handler."""
    from ray._private.log import PlainRayHandler

    return PlainRayHandler(**kwargs)


# --- Probes of Ray's behaviour for the tests --------------------------------------------------------------------------

def dashboard_url() -> str:
    """The dashboard address of the Ray this process is connected to (tests). Public alternative missing: only the
    return value of `ray.init`, which pipelines.cluster.runtime.init_ray does not pass on."""
    from ray._private.worker import get_dashboard_url

    return get_dashboard_url()


def train_actor_alive(actor_id: str, timeout: float) -> bool:
    """Ray Train's own check that an actor lives (its placement-group cleaner's, through Ray's state API), for the
    tests that it works beside other Ray instances. Public alternative missing: the check itself is Ray Train's."""
    from ray.train.v2._internal.state.util import is_actor_alive

    return bool(is_actor_alive(actor_id, timeout=timeout))


def validate_cluster_config(config: dict, prepare: bool = True) -> dict:
    """Ray's own validation of a cluster config (ray_cluster.yaml's schema; `prepare`: with the defaults `ray up`
    fills in first, which needs the provider's example file). Returns the config validated. Public alternative
    missing: only `ray up`, which starts the cluster."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    if prepare:
        config = prepare_config(config)
    validate_config(config)
    return config


def node_provider_class(provider_config: dict):
    """The node provider class Ray's autoscaler loads for `provider_config` (tests). Public alternative missing."""
    from ray.autoscaler._private.providers import _get_node_provider_cls

    return _get_node_provider_cls(provider_config)


# --- The check -------------------------------------------------------------------------------------------------------

def _params(func) -> set[str]:
    return set(inspect.signature(func).parameters)


def problems() -> list[str]:
    """What of this module's use of Ray no longer holds with the installed Ray, nothing called that acts: every name of
    PRIVATE_NAMES resolves, and the shapes the functions rely on (fields, arguments, Ray's words outside a worker)
    are there. Empty when all is well."""
    out = Shortfalls(unresolved(PRIVATE_NAMES))
    if out:
        return out
    need = out.need
    from ray._private.node import Node
    from ray._private.parameter import RayParams
    from ray._private.worker import connect
    from ray._raylet import InnerGcsClient
    from ray.core.generated.autoscaler_pb2 import ClusterConfig, DrainNodeReason, NodeGroupConfig
    from ray.train import PreemptionInfo
    from ray.train.v2._internal.execution.context import TrainContext, logger
    from ray.train.v2._internal.execution.preemption import PreemptionContext

    try:
        need(_train_context() is None, "get_train_context() outside a Ray Train worker returned a context")
    except Exception as err:  # the answer of the check
        need(False, f"get_train_context() outside a Ray Train worker raised {type(err).__name__}: {err} "
                    "(not Ray's \"not been initialized\", which worker_preemption_info reads as no worker)")
    need("preemption_context" in getattr(TrainContext, "__dataclass_fields__", {}),
         "TrainContext has no preemption_context field")
    need("preemption_info" in getattr(PreemptionContext, "__dataclass_fields__", {}),
         "PreemptionContext has no preemption_info field")
    need({"deadline_ms", "preempted_node_to_ranks"} <= _params(PreemptionInfo), "PreemptionInfo's fields changed")
    need(logger.name == train_report_logger_name(),
         f"Ray Train's report logger is {logger.name!r}, not {train_report_logger_name()!r}")
    need("DRAIN_NODE_REASON_PREEMPTION" in DrainNodeReason.keys()
         and "DRAIN_NODE_REASON_IDLE_TERMINATION" in DrainNodeReason.keys(), "DrainNodeReason lost a reason")
    need("deadline_timestamp_ms" in (InnerGcsClient.drain_node.__doc__ or ""),
         "GcsClient.drain_node's arguments changed")
    need("gcs_client" in inspect.getsource(connect), "ray._private.worker.connect no longer sets worker.gcs_client")
    need({"node_group_configs"} <= set(ClusterConfig.DESCRIPTOR.fields_by_name), "ClusterConfig's fields changed")
    need({"name", "resources", "max_count"} <= set(NodeGroupConfig.DESCRIPTOR.fields_by_name),
         "NodeGroupConfig's fields changed")
    need({"gcs_address", "redis_address", "node_ip_address", "num_cpus", "resources", "labels", "min_worker_port",
          "max_worker_port", "temp_dir", "metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
          "runtime_env_agent_port"} <= _params(RayParams), "RayParams' arguments changed")
    need({"head", "shutdown_at_exit", "spawn_reaper"} <= _params(Node), "Node's arguments changed")
    need({"check_alive", "allow_graceful"} <= _params(Node.kill_all_processes), "Node.kill_all_processes' arguments")
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    need("DatasetsCallback(" in inspect.getsource(DataParallelTrainer._create_default_callbacks)
         and "self.datasets" in inspect.getsource(DataParallelTrainer.__init__),
         "DataParallelTrainer no longer makes its DatasetsCallback from self.datasets")
    need(callable(getattr(DatasetsCallback, "before_init_train_context", None)),
         "DatasetsCallback no longer starts the DatasetManager in before_init_train_context")
    provider = fake_multi_node_provider()
    # what pipelines.cluster.isolated.IsolatedNodeProvider overrides and reads of it
    for method in ("_create_node_with_resources_and_labels", "_terminate_node", "_next_hex_node_id",
                   "non_terminated_nodes", "terminate_node"):
        need(callable(getattr(provider, method, None)), f"FakeMultiNodeProvider.{method} is gone")
    init = inspect.getsource(provider.__init__)
    for attr in ("self.lock", "self._nodes", "self._gcs_address"):
        need(attr in init, f"FakeMultiNodeProvider no longer sets {attr}")
    return out
