"""Starting or joining Ray. Local runs stay on 127.0.0.1; `ray job submit` runs join the cluster."""
from __future__ import annotations

import fcntl
import logging
import os
import random
import socket
import tempfile
import warnings
from pathlib import Path

import ray

from pipelines.compat.ray_private import disable_cluster_mode_in_this_process, train_report_logger_name
from pipelines.gc_tuning import collect_less

# Without this, a single-node Ray (as measured on Linux hosts) advertises the machine's
# external address and torch.distributed's MASTER_ADDR follows it. Local runs only.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_QUIET_ENV = {
    # Per-operator progress bars flood job logs; Ray Train and our own metrics report progress.
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # Ray Train's print patch sends a worker's print() to its logger and, as a Ray worker's stdout is Ray's own
    # stream, to that stream too: every line rank 0 printed reached the job's console twice.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}
_LOCAL_ENV = {
    # A busy laptop or CI box can take over a minute to start the worker actors (Ray's default is 60 s).
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
    # Ray Train's controller collects each ray.train.report at its poll (default every 2 s) while the
    # reporting workers wait: a local run with frequent evaluations spends seconds per report on it.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    # Its actor polls Ray for the node draining of a cloud cluster's preemption notices: a one-machine Ray has none
    # (a SIGTERM to a training worker and the notice file still reach the run: pipelines.fit.preemption).
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Ray starts a worker per CPU for the first driver, ready for its tasks; a training job's processes are actors
    # with runtime environments of their own (Ray Train's controller and all it starts) or detached ones, which never
    # take those workers: two idle processes importing Ray at start-up for nothing. Tasks start theirs when they come.
    "RAY_prestart_worker_first_driver": "0",
}


_RAY_DATA_LOGGING = Path(__file__).with_name("ray_data_logging.yaml")
# Warnings that every CPU run prints and that say nothing about this run, by logger and message start.
_HARMLESS = {
    "DeepSpeed": ("Setting accelerator to CPU",),  # no GPU: DeepSpeed's CPU accelerator, as intended
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "ray.data": ("Progress bars disabled",),  # disabled on purpose (progress lines replace them)
    "mlflow.pyfunc": ("Validating input example",),
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
}
# DeepSpeed's ZeRO calls a torch collective that torch has renamed; nothing a user can act on.
_HARMLESS_WARNINGS = (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",)


class DropHarmless(logging.Filter):
    """Drops the records of _HARMLESS (all of them by default: ray_data_logging.yaml builds it without arguments)."""

    def __init__(self, starts: tuple[str, ...] | None = None):
        super().__init__()
        self.starts = starts or tuple(s for group in _HARMLESS.values() for s in group)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def worker_setup() -> None:
    """Ray's worker_process_setup_hook for this project's jobs: run in every worker process as it starts, before
    the task or actor it was started for imports anything."""
    collect_less()
    quiet_logs()


def quiet_logs() -> None:
    """Keep Ray's routine per-epoch and per-report INFO lines and known harmless warnings out of the console
    (Ray's log files keep them); other warnings and errors still show. Runs in the driver and, through Ray's
    worker_process_setup_hook (`worker_setup`), in every worker process before it imports ray.data."""
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", str(_RAY_DATA_LOGGING))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per artifact download
    # Ray Train V2 logs every ray.train.report at INFO, metrics dict and all, from every rank.
    logging.getLogger(train_report_logger_name()).setLevel(logging.WARNING)
    data_logger = logging.getLogger("ray.data")
    for handler in data_logger.handlers:  # ray.data already imported here: its console handler as configured
        if not isinstance(handler, logging.FileHandler) and type(handler).__name__ != "SessionFileHandler":
            handler.setLevel(max(handler.level, logging.WARNING))
            if not any(isinstance(f, DropHarmless) for f in handler.filters):
                handler.addFilter(DropHarmless())  # ray.data's child loggers log through this handler
    for name, starts in _HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropHarmless) for f in logger.filters):
            logger.addFilter(DropHarmless(starts))
    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard_port: int = 8265) -> None:
    """Join `address` / $RAY_ADDRESS if given (cluster, job submission), else start a local Ray on loopback
    with its dashboard on `dashboard_port`, or on a free port when that one is taken."""
    if ray.is_initialized():
        return
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    quiet_logs()  # before ray.data is imported here, so its logging config is ours
    # The env var is read when ray.data is imported, which may already have happened.
    from ray.data import DataContext  # deferred: after RAY_DATA_LOGGING_CONFIG is set (read at import)

    DataContext.get_current().enable_progress_bars = False
    quiet_logs()  # and again, for a ray.data that was imported earlier with Ray's own console handler
    address = address or os.environ.get("RAY_ADDRESS")
    hook = f"{__name__}.worker_setup"
    if address:
        # merged with the runtime_env of a `ray job submit` (its working_dir stays)
        ray.init(address=address, log_to_driver=True,
                 runtime_env={"env_vars": dict(_QUIET_ENV), "worker_process_setup_hook": hook})
        return
    for key, value in _LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    local_env = {key: os.environ[key] for key in _LOCAL_ENV}  # a value the user set wins
    os.environ.update(_LOOPBACK_ENV)  # for the processes Ray starts (they import ray afresh)
    # This process imported ray before the variable was set; its constant is read at import time.
    disable_cluster_mode_in_this_process()
    # The dashboard (on 127.0.0.1) serves the state API, which Ray Train's placement-group cleaner needs:
    # without it, the worker placement group of a run whose controller is killed (a sweep trial that
    # ASHA stops) is never released and later trials wait forever for CPUs.
    # Ray's state API (which that cleaner calls) finds the dashboard by looking for the machine's Ray instance
    # and refuses when it finds several ("Found multiple active Ray instances", e.g. two runs on one
    # workstation); naming this instance's dashboard in its processes' environment avoids the lookup.
    # The port is checked free, then bound by the dashboard Ray starts: two local runs starting at once (two
    # pytest workers, two jobs on a workstation) would both see 8265 free, so they take turns.
    # The ports Ray picks itself (or keeps fixed) can still be taken by another instance starting at that moment
    # (two pytest workers starting their clusters at once: the head can fail after its GCS): one more try, on
    # ports chosen again.
    for attempt in (1, 2):
        with port_lock():
            port = local_port(dashboard_port)
            api_env = {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
            try:
                ray.init(
                    address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                    dashboard_port=port, _node_ip_address="127.0.0.1",
                    runtime_env={"env_vars": {**local_env, **_LOOPBACK_ENV, **_QUIET_ENV, **api_env},
                                 "worker_process_setup_hook": hook},
                )
                return
            except Exception as err:  # Ray raises several kinds here (RuntimeError, ConnectionError, ValueError)
                ray.shutdown()
                if attempt == 2:
                    raise
                logging.getLogger(__name__).warning("starting a local Ray failed (%s: %s); trying once more",
                                                    type(err).__name__, err)


def port_lock() -> "_machine_lock":
    """Held while a local Ray (or local cluster) picks its ports and binds them: processes starting Ray at
    the same time on this machine take turns instead of both taking a port they each saw free."""
    return _machine_lock("probvlp-ray-dashboard.lock")


class _machine_lock:
    """An exclusive lock shared by this machine's processes (a file in the temp folder, released on exit)."""

    def __init__(self, name: str):
        self.path = Path(tempfile.gettempdir()) / name

    def __enter__(self):
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def local_port(preferred: int = 0) -> int:
    """`preferred` (e.g. Ray's default dashboard port 8265) if free on 127.0.0.1, else a free port above Ray's worker
    ports (10002-19999) and below the kernel's ephemeral range. A free port of that range (what binding port 0 gives)
    is what every outgoing connection takes its local port from: with many Ray processes connecting, one can take it
    between this check and the server's bind (seen: a Ray head's agent lost its port that way, so no job could start)."""
    low = _ephemeral_low()
    candidates = random.Random().sample(range(20000, low), min(64, low - 20000)) if low > 20000 else []
    for port in ([preferred] if preferred else []) + candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere IANA's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def local_cpus(num_workers: int, cpus_per_worker: float) -> int:
    """Logical CPUs for a local Ray: the training workers plus room for Ray Data's tasks."""
    return max(os.cpu_count() or 1, int(num_workers * cpus_per_worker) + 2)
