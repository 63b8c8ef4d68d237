"""Config loading: typed sections, one-line errors naming the key, overrides, CLI exit codes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError
from pipelines.pretrain.config import TrainDocument, load_train_config
from pipelines.download.config import load_download_config
from pipelines.evaluate.config import load_evaluate_config
from pipelines.tune.config import load_tune_config
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, data) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_demo_config_loads_and_overrides():
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", ["train.steps=7", "model.overrides.embed_dim=32"])
    assert cfg.train.steps == 7 and cfg.model.overrides == {"embed_dim": 32}
    assert cfg.train.zero_stage == 2 and cfg.train.num_workers == 2 and not cfg.train.elastic
    elastic = load_train_config(ROOT / "configs" / "demo.yaml",
                                ["train.num_workers=[1, 4]", "train.zero_stage=0"]).train
    assert elastic.num_workers == (1, 4) and elastic.elastic and elastic.max_workers == 4
    for stage in (1, 2, 3):  # resharded on a resize (pipelines.zero.reshard, tests/test_reshard.py)
        assert load_train_config(ROOT / "configs" / "demo.yaml",
                                 ["train.num_workers=[1, 4]", f"train.zero_stage={stage}"])
    again = TrainDocument.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.flat()["train.steps"] == 7


def test_exponent_numbers_are_numbers_in_files_overrides_and_sweeps(tmp_path):
    """1e-4 is a float as users write it (YAML 1.2), not YAML 1.1's string: in loss and model kwargs too, which
    are checked strictly and reach the constructors as they are."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: prolip_llip_tiny\nloss:\n  name: prob_llip\n  params:\n    beta: 1e-4\n"
                    "train:\n  lr: 5E-4\n  eval_every: 5\n")
    cfg = load_train_config(path, ["loss.params.alpha1=1e-7", "loss.params.eps=-1.5e1", "model.overrides.tau=.5e1"])
    assert cfg.loss.params == {"beta": 1.0e-4, "alpha1": 1.0e-7, "eps": -15.0} and cfg.train.lr == 5.0e-4
    assert cfg.model.overrides == {"tau": 5.0} and all(type(v) is float for v in cfg.loss.params.values())
    # quoted stays text
    assert load_train_config(path, ["run.name=1e3x", "run.experiment='1e-4'"]).run.experiment == "1e-4"
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"base: {path}\nspace:\n  loss.params.beta: {{loguniform: [1e-5, 1e-3]}}\n"
                     "tune: {name: s, num_samples: 2, metric: heldout_loss/loss, mode: min}\n")
    assert load_tune_config(sweep)[0].space["loss.params.beta"].loguniform == (1.0e-5, 1.0e-3)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"train": {"stepz": 3}}, "train.stepz: unknown key"),
        ({"bogus": {}}, "bogus: unknown key"),
        ({"train": {"steps": "many"}}, "train.steps:"),
        ({"train": {"zero_stage": 4}}, "train.zero_stage:"),
        ({"train": {"lr": -1}}, "train.lr:"),
        ({"model": {"name": "nope"}}, "model.name: unknown model 'nope'"),
        ({"loss": {"name": "infonce", "params": {"temperature": 1}}}, "loss.params.temperature: unknown key"),
        ({"loss": {"name": "infonce", "params": {"init_temperature": "hot"}}}, "loss.params.init_temperature:"),
        ({"data": {"mid_caption_prob": 0.7, "general_caption_prob": 0.7}}, "mid_caption_prob + data.general"),
        ({"model": {"init_from_openclip": "/no/such/clip.safetensors"}}, "model.init_from_openclip: no such file"),
        ({"train": {"num_workers": [3, 2]}}, "train.num_workers: [min, max] with min > max (got [3, 2])"),
        ({"train": {"num_workers": [0, 2]}}, "train.num_workers: needs at least 1 worker (got [0, 2])"),
        ({"train": {"num_workers": 0}}, "train.num_workers: needs at least 1 worker (got 0)"),
        ({"train": {"elastic_resize_interval_s": 0}}, "train.elastic_resize_interval_s: Input should be greater than 0"),
    ],
)
def test_bad_values_name_the_key(tmp_path, data, expected):
    with pytest.raises(ConfigError) as err:
        load_train_config(write(tmp_path, data))
    msg = str(err.value)
    assert expected in msg and "\n" not in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_train_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_train_config(bad)
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_train_config(ROOT / "configs" / "demo.yaml", ["train.steps"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "{tmp}/unknown.yaml"], "config error: train.nonsense: unknown key"),
        (["--config", "{tmp}/wrongtype.yaml"], "config error: train.batch_size:"),
        (["--config", "{tmp}/absent.yaml"], "config error: config file not found"),
        (["--config", "configs/demo.yaml", "--set", "train.zero_stage=9"], "config error: train.zero_stage:"),
        # a model option its class refuses: checked by the class itself without building the model
        (["--config", "configs/prolip_demo.yaml", "--set", "model.overrides.mask_ratio=1.0"],
         "config error: model.overrides: prolip_tiny: mask_fraction must be in [0, 1], mask_ratio and"),
    ],
)
def test_cli_fails_fast_with_one_line(tmp_path, args, expected):
    write(tmp_path, {"train": {"nonsense": 1}}).rename(tmp_path / "unknown.yaml")
    write(tmp_path, {"train": {"batch_size": [1, 2]}}).rename(tmp_path / "wrongtype.yaml")
    argv = [a.format(tmp=tmp_path) for a in args]
    # Run the real entry point, then report whether Ray was ever imported: the error must come first.
    code = ("import sys, jobs.pretrain as job; rc = job.main(sys.argv[1:]); "
            "print('ray imported' if 'ray' in sys.modules else 'ray not imported'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert proc.stdout.strip() == "ray not imported"


def test_cli_exit_code_through_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.pretrain", "--config", str(tmp_path / "absent.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 2 and proc.stderr.startswith("config error: config file not found")


def test_local_paths_become_absolute_for_the_workers(tmp_path, monkeypatch):
    """Ray workers and Tune trials run in other directories: fit() hands them absolute local paths."""
    monkeypatch.chdir(tmp_path)
    cfg = TrainDocument.model_validate({
        "data": {"root": "data/digits"}, "tracking": {"uri": "sqlite:///runs/mlflow.db"},
        "eval": {"tasks": [{"name": "mine", "kind": "retrieval", "data": "my_eval"},
                           {"name": "zs", "kind": "zeroshot", "data": "{data.root}/eval", "templates": "t.json"},
                           {"name": "remote", "kind": "retrieval", "data": "s3://bucket/set"}]}})
    out = cfg.with_absolute_paths()
    assert out.data.root == str(tmp_path / "data" / "digits")
    assert out.tracking.uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert [t.data for t in out.eval.tasks] == [str(tmp_path / "my_eval"), "{data.root}/eval", "s3://bucket/set"]
    assert out.eval.tasks[1].templates == str(tmp_path / "t.json")
    assert out.resolved_tasks()[1].data == str(tmp_path / "data" / "digits" / "eval")
    assert out.with_absolute_paths() == out and cfg.data.root == "data/digits"  # idempotent; the original kept
    served = TrainDocument.model_validate({"tracking": {"uri": "http://127.0.0.1:5000"}}).with_absolute_paths()
    assert served.tracking.uri == "http://127.0.0.1:5000"


def test_download_config_reads_its_sections_without_the_model_registry(tmp_path):
    """jobs.download's config: the download, run, tracking and ray sections are checked, the training sections of an
    experiment file may stand beside them, and torch is not imported (start-up counts in a download's wall time)."""
    path = tmp_path / "dl.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "d"}, "model": {"name": "clip_tiny"},
                                    "download": {"input": "urls.parquet", "output": "out"}}))
    code = ("import sys; from pipelines.download.config import load_download_config; "
            f"c = load_download_config({str(path)!r}, ['download.image_size=64']); "
            "print(c.download.image_size, c.run.name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["64", "d", "False"]
    for data, message in (({"download": {"input": "u", "output": "o"}, "modle": {}}, "modle: unknown key"),
                          ({"run": {"name": "d"}}, "no `download:` section"),
                          ({"download": {"input": "u", "output": "o", "threads": 3}}, "download.threads: unknown key")):
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=message):
            load_download_config(path)


def every_section(tmp_path) -> Path:
    """An experiment file with every section pretraining reads, and a download section."""
    data = TrainDocument.model_validate({"model": {"name": "clip_tiny"}}).to_dict()
    data["download"] = {"input": "urls.parquet", "output": "out"}
    return write(tmp_path, data)


def test_an_experiment_file_is_read_by_every_stage_that_reads_one(tmp_path):
    """Pretraining, the download and the evaluation each check the sections they read and let the file's others
    stand: none refuses a section another reads (each takes the list from pipelines.config.ExperimentDocument)."""
    path = every_section(tmp_path)
    assert load_train_config(path).download == {"input": "urls.parquet", "output": "out"}  # as written
    assert load_download_config(path).download.output == "out"
    assert load_evaluate_config(path).eval.split == "test"


def test_evaluate_config_reads_the_sections_an_evaluation_uses_without_the_model_registry(tmp_path):
    """jobs.evaluate's config: the run, data, loss, eval, tracking and ray sections are checked; an experiment file's
    model, train and download sections stand beside them unchecked (the model comes from the model file); `--set`
    overrides apply; torch is not imported (a config error answers before it loads)."""
    path = tmp_path / "ev.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "e"}, "model": {"name": "no_such_model"},
                                    "train": {"no_such_key": 1}, "eval": {"split": "val"}}))
    code = ("import sys; from pipelines.evaluate.config import load_evaluate_config; "
            f"c = load_evaluate_config({str(path)!r}, ['eval.batch_size=8', 'loss.name=infonce']); "
            "print(c.eval.split, c.eval.batch_size, c.loss.name, c.run.name, ','.join(sorted(c.model_fields)), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=scaled(60)).stdout
    assert out.split() == ["val", "8", "infonce", "e", "data,eval,loss,ray,run,tracking", "False"]
    for data, overrides, message in (
            ({"modle": {}}, [], "modle: unknown key"),
            ({}, ["evl.split=val"], "evl: unknown key"),
            ({"data": {"rot": "x"}}, [], "data.rot: unknown key"),
            ({"loss": {"nam": "x"}}, [], "loss.nam: unknown key"),
            ({"eval": {"tasks": [{"name": "a", "kind": "retrieval", "prompts": "bprw"}]}}, [],
             "eval.tasks.0: prompts: only zeroshot tasks take prompts"),
            ({"eval": {"batch_size": 0}}, [], "eval.batch_size: Input should be greater than or equal to 1")):
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as err:
            load_evaluate_config(path, overrides)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), (data, str(err.value))


def test_jobs_evaluate_refuses_a_loss_it_could_not_build_before_any_work(tmp_path, capsys):
    """A loss the evaluation config names is checked against the losses and its constructor (no model registry in
    the config's load, so at the job's start): one line, exit status 2, before the model is looked for."""
    import jobs.evaluate

    path = write(tmp_path, {"loss": {"name": "infonce", "params": {"init_scal": 2.0}}})
    for overrides, message in (([], "config error: loss.params: loss 'infonce': "),
                               (["loss.name=no_such_loss"], "config error: loss.name: unknown loss 'no_such_loss'")):
        rc = jobs.evaluate.main(["--model", str(tmp_path / "absent.safetensors"), "--config", str(path),
                                 *(a for o in overrides for a in ("--set", o))])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(message), err
