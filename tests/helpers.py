"""Helpers shared by test modules (fixtures live in conftest.py and multinode.py)."""
from __future__ import annotations

import io
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tests.pace import scaled, slowness

ROOT = Path(__file__).resolve().parent.parent
# Steps of the demo CLIP that `trained_clip` trains once per pytest run.
DEMO_STEPS = 300
# The tests' object-storage bucket: tests/multinode.py's `s3` fixture creates it on its S3 server.
BUCKET = "probvlp-test"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range (see local_port)."""
    from pipelines.cluster.runtime import local_port  # imports Ray: not at conftest's import

    return local_port()


def files_under(folder: Path, leave_out: tuple[str, ...] = (), leave_out_names: tuple[str, ...] = ()) -> dict[str, int]:
    """Every file and folder under `folder`: path relative to it -> modification time in ns (-1 for a folder); empty
    where `folder` does not exist. Folders left out with all they hold: `leave_out`, by their path relative to
    `folder`; `leave_out_names`, by their name wherever they are."""
    folder = Path(folder)
    found = {}
    for top, dirs, files in os.walk(folder):
        here = Path(top).relative_to(folder)
        dirs[:] = [d for d in dirs if d not in leave_out_names and str(here / d) not in leave_out]
        for name in (*dirs, *files):
            path = here / name
            try:
                found[str(path)] = -1 if name in dirs else (folder / path).stat().st_mtime_ns
            except OSError:  # removed meanwhile
                continue
    return found


def official_switches(recipe: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """configs/{recipe}_official.yaml's model overrides and loss params, as the project loads them: the switches where
    the official code and the paper differ (docs/FIDELITY.md). An adapter's recipe (jobs.adapt's config): no
    overrides."""
    from pipelines.adapt.config import load_adapt_config
    from pipelines.config import read_config_file
    from pipelines.pretrain.config import load_train_config

    path = ROOT / "configs" / f"{recipe}_official.yaml"
    if "source" in read_config_file(path):
        return {}, dict(load_adapt_config(path).loss.params)
    cfg = load_train_config(path)
    return dict(cfg.model.overrides), dict(cfg.loss.params)


def written_between(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The paths of `after` (files_under) that `before` lacks, and its files modified since."""
    return sorted(p for p, t in after.items() if p not in before or (t >= 0 and t != before[p]))


_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\([^)]*\)(?:\x1b\[0m)? ?")


def tracebacks(log: str) -> list[str]:
    """The Python tracebacks in a job's console, each as its lines without Ray's `(actor pid=N)` prefix, leaving out
    the two Ray itself prints at teardown, where nothing of the run's own is lost:
    - a finished actor's SIGTERM landing while Python runs a finaliser, printed as `Exception ignored in ...` with
      Ray's sigterm_handler raising SystemExit;
    - Ray Train's controller, as its run ends, giving up on stopping its placement-group cleaner within ~12 s
      (`Failed to stop PlacementGroupCleaner gracefully.`, a GetTimeoutError from `_stop_cleaner`): the cleaner's
      check of the controller through the state API ran long on a loaded machine; left alone, the cleaner finds the
      run's placement group already removed once the controller is gone, and exits."""
    lines = [_RAY_PREFIX.sub("", line) for line in log.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j].startswith(" ")), len(lines) - 1)
        block = lines[i:end + 1]
        teardown = (i > 0 and lines[i - 1].startswith("Exception ignored in")
                    and any("in sigterm_handler" in x for x in block) and block[-1].startswith("SystemExit"))
        cleaner = (len(block) > 1 and "ray/train/v2/_internal/callbacks/placement_group_callback.py" in block[1]
                   and block[1].endswith("in _stop_cleaner")
                   and block[-1].startswith("ray.exceptions.GetTimeoutError"))
        if not (teardown or cleaner):
            found.append("\n".join(block))
    return found


def wait_for(what: str, probe, timeout_s: float = 300, every_s: float = 0.5):
    """Poll `probe` until it returns something truthy (returned), or fail naming `what` was still missing.
    `timeout_s` is the deadline on the reference machine, scaled to this one (tests.pace)."""
    limit = scaled(timeout_s)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"still missing after {limit:.0f}s ({timeout_s:g}s x{slowness():.2f} for this machine's "
                         f"speed): {what}")


def actors_started(kind: str) -> int:
    """Actors whose class name holds `kind` (DatasetManager, TextEmbedder, ...) that this process's Ray has started so
    far, dead ones too (the GCS keeps their records): what a test counts before and after what it runs."""
    import ray
    from ray.util.state import list_actors

    return sum(kind in a.class_name for a in list_actors(ray.get_runtime_context().gcs_address, limit=10_000,
                                                         raise_on_missing_output=False))


def wait_http(url: str, proc, timeout: float = 120) -> None:
    """Wait until `url` answers (any HTTP status) while the server process `proc` runs (`timeout` scaled as
    wait_for's)."""
    import urllib.request

    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError as err:
            if getattr(err, "code", None):  # an HTTP error status: the server answers
                return
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


class Hold:
    """A point of a run where rank 0 stops until the test releases it (pipelines.fit.faults.hold_at, tests only):
    what the test does "during" that point then happens there whatever the machine's speed. `folder` (created) holds
    the files through which the worker and the test talk: on rank 0's node, this machine."""

    def __init__(self, folder: Path, point: str | None = None):
        from pipelines.fit.faults import FINAL_EVALUATION

        self.folder, self.point = Path(folder), point or FINAL_EVALUATION
        self.folder.mkdir(parents=True, exist_ok=True)

    def armed(self) -> dict[str, str]:
        return {self.point: str(self.folder)}

    def held(self) -> int:
        """How many times rank 0 has stopped there so far (each attempt that reached the point once)."""
        from pipelines.fit.faults import held_file

        path = held_file(self.folder, self.point)
        return len(path.read_text().splitlines()) if path.exists() else 0

    def release(self) -> None:
        """Rank 0 goes on, now and at every later stop there."""
        from pipelines.fit.faults import released_file

        released_file(self.folder, self.point).touch()


@contextmanager
def holds_armed(holds: tuple[Hold, ...]):
    """Within the block, every run this process launches hands `holds` to its workers in the training loop's config,
    as no job of the product does."""
    from pipelines.fit.faults import HOLDS
    from pipelines.fit.launch import Launch

    fit = Launch.train
    armed = {point: folder for hold in holds for point, folder in hold.armed().items()}

    def fit_with_holds(self, loop, loop_config, *args, **kwargs):
        return fit(self, loop, {**loop_config, HOLDS: armed}, *args, **kwargs)

    if holds:
        Launch.train = fit_with_holds
    try:
        yield
    finally:
        Launch.train = fit


def pretrain_beside(cfg, action, holds: tuple[Hold, ...] = ()):
    """`jobs.pretrain`'s run of `cfg` while `action()` (what a test does to the run: a notice, a kill) runs in a thread;
    the thread's error, raised once the run has ended. `holds`: points where rank 0 stops until `action` releases
    them (holds_armed); whatever way `action` ends, they are released then, so that the run never waits for ever.
    Returns the run's result."""
    import threading

    from pipelines.pretrain.job import run_pretrain

    errors: list[BaseException] = []

    def act() -> None:
        try:
            action()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
        finally:
            for hold in holds:
                hold.release()

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    with holds_armed(holds):
        result = run_pretrain(cfg)
    thread.join()
    if errors:
        raise errors[0]
    return result


def _registrations(run_folder, fs=None) -> list[dict]:
    """Ray Train's snapshot file of a run's registered checkpoints, read from a local folder or, with `fs` (an fsspec
    filesystem: S3), from object storage; [] before it is written (or caught mid-write)."""
    try:
        if fs is None:
            snapshot = json.loads((Path(run_folder) / "checkpoint_manager_snapshot.json").read_text())
        else:
            fs.invalidate_cache()  # a listing cached before the snapshot was written would hide it
            snapshot = json.loads(fs.cat(f"{run_folder}/checkpoint_manager_snapshot.json"))
        return snapshot["checkpoint_results"]
    except (OSError, ValueError, KeyError):
        return []


def registered(run_folder, fs=None) -> list[str]:
    """The folders of the checkpoints Ray Train has registered for a run, which a restart resumes from (a checkpoint
    folder appears while it is still being written, before that)."""
    return [c["checkpoint_dir_name"] for c in _registrations(run_folder, fs)]


def registered_steps(run_folder, fs=None) -> list[int]:
    """The steps of the checkpoints Ray Train has registered for a run (their reports' metrics)."""
    return [c["metrics"]["step"] for c in _registrations(run_folder, fs)]


def jpeg(seed: int, size=(48, 40)) -> bytes:
    """A JPEG of random pixels, the same for the same seed."""
    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def failed_evaluation_keeps_the_model(cfg, tmp: Path, device: str = "cpu") -> None:
    """`cfg` trains to the end and its final evaluation fails (eval.calibration_bins above the eval sets' query
    count): the run raises EvaluationError naming the task, the MLflow run is FAILED with that one-line reason,
    and the model saved before the evaluation loads from MLflow (model file strictly, pyfunc predicts)."""
    import mlflow
    import mlflow.pyfunc
    import pandas as pd
    import pytest
    import torch
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from safetensors.torch import load_file

    from models.model_file import load_model
    from models.preprocess import encode_png
    from pipelines.evaluate import EvaluationError
    from pipelines.tracking import find_run, model_file
    from pipelines.pretrain.job import run_pretrain

    uri = cfg.tracking.uri
    with pytest.raises(EvaluationError, match=r"evaluation task 'digits_zeroshot' failed: ValueError: .*calibration"):
        run_pretrain(cfg)
    run_id = find_run(uri, cfg.run.experiment, cfg.run.name)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED"
    reason = run.data.tags["probvlp.failure"]
    assert "\n" not in reason and "digits_zeroshot" in reason and "calibration_bins" in reason, reason
    assert run.data.tags["probvlp.device"].startswith(device)
    (tmp / "dl").mkdir(parents=True, exist_ok=True)
    folder = Path(download_artifacts(run_id=run_id, artifact_path="model", dst_path=str(tmp / "dl"), tracking_uri=uri))
    model = load_model(model_file(folder)).to(device)  # strict: every tensor of the architecture, no unpickling
    probe = load_file(str(folder / "probe.safetensors"))
    with torch.no_grad():
        image = model.encode_image(probe["images"].to(device))
    assert torch.allclose(image["mu"].cpu(), probe["image_mu"], atol=1e-5)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        pyfunc = mlflow.pyfunc.load_model(f"runs:/{run_id}/model")
    finally:
        mlflow.set_tracking_uri(previous)
    out = pyfunc.predict(pd.DataFrame({"image": [encode_png(probe["images"][0].numpy())], "caption": ["a photo"]}))
    assert len(out["image_mu"][0]) == probe["image_mu"].shape[1]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`, its processes forked from a server that has imported torch and DeepSpeed once:
    a spawned gloo rank spends seconds of CPU importing them afresh, and the tests start dozens of ranks."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "deepspeed", "torch.distributed"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
