"""End to end: tiny CLIP on the bundled digits with 2 Ray Train workers under DeepSpeed ZeRO-2."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from safetensors.torch import load_file

from models.model_file import load_model
from pipelines.pretrain.config import TrainDocument
from pipelines.tracking import StepLogger, model_file, redact
from tests.helpers import DEMO_STEPS
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
STEPS = DEMO_STEPS


@pytest.fixture(scope="module")
def trained(trained_clip):
    return trained_clip


def run_of(result):
    return MlflowClient(result.mlflow_uri).get_run(result.mlflow_run_id)


def test_learns_digits(trained):
    cfg, result, _ = trained
    assert result.metrics["step"] == STEPS
    assert result.metrics["digits_zeroshot/top1"] >= 0.70
    history = [m.value for m in MlflowClient(result.mlflow_uri).get_metric_history(result.mlflow_run_id, "loss")]
    assert len(history) == STEPS // cfg.train.log_every
    assert sum(history[-5:]) / 5 < 0.8 * sum(history[:3]) / 3


def test_checkpoints_by_the_clock_are_whole_and_cost_the_loop_only_their_snapshot(trained):
    """train.checkpoint_every_s=15 and no train.checkpoint_every: the run's checkpoints before its end are the clock's,
    each saved by both ranks at one step (their shards in one folder, named by the step that the progress inside
    holds), uploaded behind training; rank 0 logs what each save blocked the loop."""
    cfg, result, _ = trained
    from tests.helpers import registered
    from tests.small_runs import load_state

    folder = Path(cfg.run.storage_path) / cfg.run.name
    kept = registered(folder)
    assert kept[-1] == f"checkpoint_{STEPS:08d}_attempt001" and len(kept) == cfg.run.keep_checkpoints, kept
    clock = kept[0]
    step = int(clock.split("_")[1])
    assert 0 < step < STEPS
    state = load_state(str(folder / clock))
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= set(state)
    assert state["mp_rank_00_model_states.pt"]["progress"]["step"] == step
    blocked = MlflowClient(result.mlflow_uri).get_metric_history(result.mlflow_run_id, "checkpoint_blocked_s")
    assert {m.step for m in blocked} >= {step, STEPS} and all(m.value >= 0 for m in blocked)


def test_the_time_to_the_first_step_is_logged(trained):
    """Start-up, what every job and sweep trial pays before it trains: rank 0 logs the seconds from the job's start
    (here the call of pretrain) to its first step, once, at step 1 (benchmarks/startup.py measures the same from
    outside)."""
    _, result, _ = trained
    [startup] = MlflowClient(result.mlflow_uri).get_metric_history(result.mlflow_run_id, "startup_s")
    assert startup.step == 1 and 0 < startup.value < scaled(300)


def test_training_compiles_no_cpp_ops(trained):
    """DeepSpeed's CPU all-reduce op serves inference only; a JIT build of it costs a minute before the first step."""
    built = sorted(p.name for p in Path(os.environ["TORCH_EXTENSIONS_DIR"]).rglob("*.so"))
    assert not built, f"training JIT-built C++ ops: {built}"


def test_params_hide_secrets_and_show_every_knob():
    params = {"model.overrides.mixture_tokens": 4, "data.max_tokens": 77, "env.HF_TOKEN": "hf_abc", "auth.token": "t",
              "db.password": "p", "s3.secret-key": "k", "api_key": "k", "openai.API-KEY": "k", "gcs.credentials": "c",
              "tracking.uri": "https://user:pw@mlflow.example/x", "data.root": "s3://bucket/tokens"}
    shown = redact(params)
    hidden = {k for k, v in shown.items() if v == "***"}
    assert hidden == {"env.HF_TOKEN", "auth.token", "db.password", "s3.secret-key", "api_key", "openai.API-KEY",
                      "gcs.credentials"}
    assert shown["model.overrides.mixture_tokens"] == 4 and shown["data.max_tokens"] == 77
    assert shown["tracking.uri"] == "https://***@mlflow.example/x" and shown["data.root"] == "s3://bucket/tokens"


def test_a_restart_does_not_write_steps_mlflow_already_has(tmp_path):
    """A worker wrote steps 1-10 (flushed with the step-10 checkpoint) but the run restarted from step 5, whose
    checkpoint was the last registered: the replay of steps 6-10 is not written again (what it adds there is), step 11
    on is. A restart at the last step writes what its end adds at that step (the final evaluation)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("restarts")
    run_id = client.create_run(experiment).info.run_id
    first = StepLogger(uri, run_id, flush_every=None)
    for step in range(1, 11):
        first.log({"loss": float(step)}, step)
    first.flush()
    replay = StepLogger(uri, run_id, flush_every=None, resumed_from=5)
    for step in range(6, 13):  # step 10's evaluation: the first worker had written the loss there, not that
        replay.log({"loss": 100.0 + step, **({"val/top1": 0.5} if step == 10 else {})}, step)
    replay.flush()
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(s, float(s)) for s in range(1, 11)] + [(11, 111.0), (12, 112.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/top1")] == [(10, 0.5)]
    end = StepLogger(uri, run_id, flush_every=None, resumed_from=12)
    end.log({"eval/top1": 0.9}, 12)
    end.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/top1")] == [(12, 0.9)]
    fresh = StepLogger(uri, client.create_run(experiment).info.run_id, flush_every=None, resumed_from=5)
    fresh.log({"loss": 6.0}, 6)  # a resumed run that had written nothing writes every step
    fresh.flush()
    assert [m.step for m in client.get_metric_history(fresh.run_id, "loss")] == [6]


def test_mlflow_run_reads_back(trained):
    cfg, result, tmp = trained
    run = run_of(result)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.zero_stage"] == "2" and params["model.name"] == "clip_tiny"
    assert params["train.num_workers"] == "2" and params["train.steps"] == str(STEPS)
    assert run.data.metrics["digits_zeroshot/top1"] == pytest.approx(result.metrics["digits_zeroshot/top1"])
    assert {"loss", "lr", "logit_scale", "samples_per_s", "data_wait_frac", "data_wait_ms"} <= set(run.data.metrics)
    # the share of the loop spent waiting for batches, per logging window and over the run
    assert 0 <= run.data.metrics["data_wait_frac"] <= 1 and run.data.metrics["data_wait_ms"] >= 0
    assert 0 < result.metrics["data_wait_frac_mean"] < 1
    # All torch.distributed traffic of the local run stayed on loopback.
    assert run.data.tags["probvlp.master_addr"] == "127.0.0.1"
    assert run.data.tags["probvlp.world_size"] == "2"

    # artifacts beside the sqlite file (MLflow's default, ./mlruns of the creating process, is not shared)
    assert run.info.artifact_uri.startswith((tmp / "mlartifacts").as_uri())
    assert (tmp / "mlartifacts").is_dir()
    saved = download_artifacts(run_id=result.mlflow_run_id, artifact_path="config.yaml",
                               dst_path=str(tmp / "dl"), tracking_uri=result.mlflow_uri)
    assert TrainDocument.from_dict(yaml.safe_load(Path(saved).read_text())) == cfg


def test_saved_model_reloads_with_same_embeddings(trained):
    _, result, tmp = trained
    folder = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="model",
                                     dst_path=str(tmp / "dl_model"), tracking_uri=result.mlflow_uri))
    model = load_model(model_file(Path(folder)))  # safetensors: no code is unpickled
    probe = load_file(str(folder / "probe.safetensors"))
    with torch.no_grad():
        image_mu = model.encode_image(probe["images"])["mu"]
        text_mu = model.encode_text(probe["tokens"])["mu"]
    assert torch.allclose(image_mu, probe["image_mu"], atol=1e-6)
    assert torch.allclose(text_mu, probe["text_mu"], atol=1e-6)
    assert not torch.allclose(image_mu[0], image_mu[1], atol=1e-3)  # real, distinct embeddings


def test_the_summary_shows_the_saved_models_predictions(trained):
    """jobs.pretrain's closing lines: four held-out images of the zero-shot task with the class the trained model picks,
    worked out by rank 0 beside its final evaluation (the driver loads no model); the saved model, reloaded here,
    picks the same classes for those images, and each image's true class is its label in the data."""
    from pipelines.data.eval_reader import REQUIRES, iter_local_batches
    from pipelines.data.eval_tasks import task_paths
    from pipelines.evaluate.in_process import embed_texts, task_texts
    from pipelines.evaluate.tasks import classes_from_prompts
    from pipelines.pretrain.run_summary import run_summary

    cfg, result, tmp = trained
    lines = run_summary(cfg, result)
    start = lines.index("sample predictions: 4 held-out images of eval task 'digits_zeroshot' (zeroshot)")
    assert lines[start + 5] == "  (no sigma^2: CLIP is a deterministic model)"
    shown = [re.fullmatch(r"  image (\S+) \(true: '(\w+)'\) -> '(\w+)'", x) for x in lines[start + 1 : start + 5]]
    assert all(shown), lines[start : start + 6]
    task = next(t for t in cfg.resolved_tasks() if t.name == "digits_zeroshot")
    batch = next(b for b in iter_local_batches(task_paths(task), cfg.data.image_size, 64, REQUIRES[task.kind]))
    rows = {str(k): i for i, k in enumerate(batch["key"])}
    folder = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="model",
                                     dst_path=str(tmp / "dl_model_summary"), tracking_uri=result.mlflow_uri))
    model = load_model(model_file(Path(folder)))
    texts, counts, classnames = task_texts(task, [])
    with torch.no_grad():
        image = model.encode_image(torch.as_tensor(batch["image"][[rows[m[1]] for m in shown]]))
        best = model.class_scores(image, classes_from_prompts(model, embed_texts(model, texts), counts)).argmax(1)
    assert [m[3] for m in shown] == [classnames[j] for j in best.tolist()]
    assert [m[2] for m in shown] == [classnames[int(batch["cls"][rows[m[1]]])] for m in shown]


PYFUNC_SCRIPT = """
import json, sys
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
images = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
captions = json.loads(sys.argv[3])
rows = len(images) + len(captions)
frame = pd.DataFrame({"image": images + [None] * len(captions), "caption": [None] * len(images) + captions})
out = model.predict(frame)
import models
print(json.dumps({"models_from": models.__file__, "columns": list(out.columns),
                  "image_mu": out["image_mu"][: len(images)].tolist(),
                  "text_mu": out["text_mu"][len(images):].tolist(),
                  "empty": [out["text_mu"][0] is None, out["image_mu"][rows - 1] is None]}))
"""


def test_mlflow_model_loads_in_a_fresh_python(trained, tmp_path):
    """`mlflow.pyfunc.load_model("runs:/<id>/model")` in another process, from another directory, gives the
    embeddings the trained model gave (the probe), importing the model code logged with it."""
    import json
    import subprocess
    import sys

    from models.preprocess import encode_png

    _, result, tmp = trained
    folder = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="model",
                                     dst_path=str(tmp / "dl_pyfunc"), tracking_uri=result.mlflow_uri))
    probe = load_file(str(folder / "probe.safetensors"))
    images = [encode_png(img.numpy()).hex() for img in probe["images"][:4]]
    captions = ["a photo of the number three", "zero"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": result.mlflow_uri}
    out = subprocess.run([sys.executable, "-c", PYFUNC_SCRIPT, f"runs:/{result.mlflow_run_id}/model",
                          json.dumps(images), json.dumps(captions)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "/code/models/" in got["models_from"] and str(ROOT) not in got["models_from"]
    assert got["columns"] == ["image_mu", "text_mu"]  # CLIP is deterministic: no sigma^2 columns
    assert got["empty"] == [True, True]  # rows without a caption / an image get None
    assert torch.allclose(torch.tensor(got["image_mu"]), probe["image_mu"][:4], atol=1e-5)
    model = load_model(model_file(folder))
    from models.tokenizer import tokenize

    with torch.no_grad():
        text_mu = model.encode_text(tokenize(captions, model.context_length))["mu"]
    assert torch.allclose(torch.tensor(got["text_mu"]), text_mu, atol=1e-5)


def test_mlflow_model_registered_with_summary(trained):
    cfg, result, tmp = trained
    client = MlflowClient(result.mlflow_uri, registry_uri=result.mlflow_uri)
    versions = client.search_model_versions(f"name = '{cfg.tracking.register_as}'")
    assert [(str(v.version), v.run_id) for v in versions] == [(result.registered_version, result.mlflow_run_id)]
    summary = Path(download_artifacts(run_id=result.mlflow_run_id, artifact_path="eval/summary.md",
                                      dst_path=str(tmp / "dl_summary"), tracking_uri=result.mlflow_uri)).read_text()
    top1 = result.metrics["digits_zeroshot/top1"]
    assert f"| digits_zeroshot | top1 | {top1:.4f} |" in summary


def test_local_ray_stays_on_loopback(ray_local):
    nodes = ray_local.nodes()
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes)
    assert ray_local.get_runtime_context().gcs_address.startswith("127.0.0.1:")
