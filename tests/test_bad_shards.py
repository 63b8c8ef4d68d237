"""Training, evaluation and batch inference on shards with every kind of fault (tests/faults.py): nothing stops a
run, every skipped sample and broken file is counted by reason (summary, MLflow, skipped.json) as it was put in, and a
run past data.max_bad_frac stops with one line. The shards are written once for the module; one fit serves the
training, jobs.evaluate and jobs.embed checks."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

import jobs.embed
import jobs.evaluate
import jobs.pretrain
from pipelines.digits.dataset import NAMES, iter_digits, retrieval_captions, specific_captions
from pipelines.data.stats import slug
from tests.helpers import actors_started
from tests.faults import FORMS, good_sample, sample_faults, write_split, write_tar

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "prolip_demo.yaml")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """{root}/train (digits + every fault + broken files), {root}/test (the same kinds), {root}/eval/zeroshot (a
    sample without a class, an undecodable one) and {root}/eval/retrieval (clean): the demo config's eval tasks.
    Returns (root, {dataset: Expected})."""
    root = tmp_path_factory.mktemp("faulty")
    digits = list(iter_digits(32))
    split = {s: [d for d in digits if d.split == s] for s in ("train", "val", "test")}
    forms = list(FORMS)
    train_good = [good_sample(d, forms[i] if i < len(forms) else None) for i, d in enumerate(split["train"])]
    image = split["train"][0].image
    expected = {
        "train": write_split(root / "train", train_good, sample_faults(900000, image), 250, True,
                             [good_sample(d) for d in split["val"][:40]], keep=25),
        "test": write_split(root / "test", [good_sample(d) for d in split["test"]], sample_faults(910000, image),
                            200, True, [good_sample(d) for d in split["val"][40:80]], keep=10),
    }
    zs_faults = [f for f in sample_faults(920000, image, eval_only=True)
                 if f.reason in ("no class", "undecodable image")][-2:]
    zs = [{"__key__": d.key, "jpg": good_sample(d)["jpg"], "cls": str(d.label).encode()} for d in split["test"]]
    write_tar(root / "eval" / "zeroshot" / "test" / "0.tar", zs[:5] + [f.sample for f in zs_faults] + zs[5:])
    (root / "eval" / "zeroshot" / "classnames.txt").write_text("\n".join(NAMES) + "\n")
    prompts = {NAMES[c]: specific_captions(c) for c in range(10)}
    (root / "eval" / "zeroshot" / "prompts.json").write_text(json.dumps(prompts))
    pairs = [{"__key__": d.key, "jpg": good_sample(d)["jpg"],
              "txt": "\n".join(retrieval_captions({**d.meta, "digit_index": int(d.key)})).encode()}
             for d in split["test"]]
    write_tar(root / "eval" / "retrieval" / "test" / "0.tar", pairs)
    assert [f.reason for f in zs_faults] == ["undecodable image", "no class"]
    return root, expected, zs_faults


def overrides(root: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    sets = ["data.source=shards", f"data.root={root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"run.storage_path={tmp}/ray", f"run.name={name}", "run.experiment=bad-shards", "train.steps=12",
            "train.log_every=4", *extra]
    return [a for s in sets for a in ("--set", s)]


def by_reason(metrics: dict, dataset: str) -> dict[str, int]:
    prefix = f"data/{dataset}/skipped/"
    return {k[len(prefix):]: int(v) for k, v in metrics.items() if k.startswith(prefix)}


def files_by_reason(expected) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason, _ in expected.files.values():
        out[slug(reason)] = out.get(slug(reason), 0) + 1
    return out


def fit(root: Path, tmp: Path, name: str, *extra: str):
    """The run's exit code, what it printed, its MLflow run and URI, its folder, and how many DatasetManager actors
    (Ray Train's, splitting Ray datasets among the workers) it started."""
    out = io.StringIO()
    managers = actors_started("DatasetManager")
    with contextlib.redirect_stdout(out):
        rc = jobs.pretrain.main(["--config", DEMO, *overrides(root, tmp, name, *extra)])
    managers = actors_started("DatasetManager") - managers
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("bad-shards").experiment_id],
                             filter_string=f"tags.`probvlp.run_name` = '{name}'")[0]
    return rc, out.getvalue(), run, uri, tmp, managers


@pytest.fixture(scope="module")
def trained(ray_local, faulty, tmp_path_factory):
    """The demo on the faulty shards, read as a small set is by default (by the training workers themselves)."""
    return fit(faulty[0], tmp_path_factory.mktemp("bad_fit"), "bad-fit")


@pytest.fixture(scope="module")
def trained_by_ray_data(ray_local, faulty, tmp_path_factory):
    """The same through Ray Data's read and map tasks (data.reader: ray_data, what a set past 512 MB takes)."""
    return fit(faulty[0], tmp_path_factory.mktemp("bad_fit_ray_data"), "bad-fit-ray-data", "data.reader=ray_data")


@pytest.mark.slow  # trains: its fit is a fixture taken by name (getfixturevalue), which conftest's check cannot see
@pytest.mark.parametrize("reader", ["trained", "trained_by_ray_data"])
def test_training_on_faulty_shards_finishes_and_counts_every_fault(faulty, reader, request):
    _, expected, zs_faults = faulty
    rc, printed, run, uri, tmp, managers = request.getfixturevalue(reader)
    assert rc == 0, printed[-3000:]
    assert run.info.status == "FINISHED"
    # Ray Train's DatasetManager, one an attempt, only for a run that hands it Ray datasets (pipelines.fit.trainer)
    assert managers == (1 if reader == "trained_by_ray_data" else 0), managers
    metrics = run.data.metrics
    for dataset, exp in (("train", expected["train"]), ("eval_heldout", expected["test"]),
                         ("eval_heldout_loss", expected["test"])):
        want = {slug(r): n for r, n in exp.skipped("caption").items()}
        assert by_reason(metrics, dataset) == want, dataset
        assert metrics[f"data/{dataset}/skipped"] == sum(want.values())
        assert metrics[f"data/{dataset}/bad_files"] == 3
        assert {k.rsplit("/", 1)[1]: int(v) for k, v in metrics.items()
                if k.startswith(f"data/{dataset}/bad_files/")} == files_by_reason(exp)
    assert by_reason(metrics, "eval_digits_zeroshot") == {"undecodable_image": 1, "no_class": 1}
    assert by_reason(metrics, "eval_digits_retrieval") == {} and metrics["data/eval_digits_retrieval/bad_files"] == 0
    n_train = len(expected["train"].delivered("caption"))
    # over the samples read: each epoch's, the last one's partly (10 / (n_train + 10) over whole epochs)
    assert 0.5 * 10 / (n_train + 10) < metrics["data/train/skipped_frac"] < 1.5 * 10 / (n_train + 10)
    # the summary: counts by reason with example keys, every broken file with its reason
    assert re.search(r"data \(train\): 10 samples skipped, [\d.]+% of those read:", printed)
    assert re.search(r"  undecodable image: 3, e\.g\. 900000 \(0000\d\.tar\), 900001", printed)
    assert "  no caption: 2, e.g. 900007" in printed and "  caption not UTF-8: 1, e.g. 900009" in printed
    for name, (reason, kept) in expected["train"].files.items():
        line = next(x for x in printed.splitlines() if x.startswith("data (train): skipped file") and name in x)
        assert reason in line and (f"{kept} samples before the break kept" in line) == (kept > 0), line
    # the examples as an artifact
    folder = download_artifacts(run_id=run.info.run_id, artifact_path="data", dst_path=str(tmp / "dl"),
                                tracking_uri=uri)
    report = json.loads((Path(folder) / "skipped.json").read_text())
    assert report["train"]["examples"]["image too large"][0][1] == "900003"
    assert report["train"]["files"][str(faulty[0] / "train" / "90000.tar")]["kept"] == 25
    # training went on: the model is there and evaluated
    assert "digits_zeroshot/top1" in metrics and "heldout/rsum" in metrics


def test_past_max_bad_frac_the_run_stops_with_one_line(ray_local, faulty, tmp_path, capsys):
    root, expected, _ = faulty
    # one worker: rank 0 stops the run on the readers' shared counts (their sum over two readers: the test above)
    rc = jobs.pretrain.main(["--config", DEMO, *overrides(root, tmp_path, "too-bad", "data.max_bad_frac=0.004",
                                                          "train.steps=40", "train.log_every=2",
                                                          "train.num_workers=1")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 2
    assert len(err) == 1, err  # one line (beside Ray's own start-up lines)
    line = re.fullmatch(r"error: training data: [\d.]+% of the samples read were skipped, over data\.max_bad_frac "
                        r"0\.004; mostly ([a-z][a-z0-9 -]*) \(\d+\), e\.g\. \S+/train/0000\d\.tar \(sample 90000\d\) "
                        r"\(MLflow run \w+ FAILED\)", err[0])
    # the commonest reason among the samples read by then: which one depends on how far the readers got
    assert line and line.group(1) in set(expected["train"].skipped("caption")), err[0]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("bad-shards").experiment_id])[0]
    assert run.info.status == "FAILED" and "data.max_bad_frac" in run.data.tags["probvlp.failure"]
    assert run.data.metrics["data/train/skipped_frac"] > 0.004


def test_jobs_evaluate_reports_what_it_skipped(faulty, trained, tmp_path, capsys):
    root, expected, _ = faulty
    _, _, run, uri, tmp, _ = trained
    out = tmp_path / "eval"
    rc = jobs.evaluate.main(["--model", f"runs:/{run.info.run_id}/model", "--config", DEMO, "--out", str(out),
                             "--actors", "1", *overrides(root, tmp, "bad-eval")])
    printed = capsys.readouterr().out
    assert rc == 0
    want = {slug(r): n for r, n in expected["test"].skipped("caption").items()}
    client = MlflowClient(uri)
    evaluation = client.search_runs([client.get_experiment_by_name("bad-shards").experiment_id],
                                    filter_string="tags.`probvlp.kind` = 'evaluation'")[0]
    for task in ("heldout", "heldout_loss"):
        assert by_reason(evaluation.data.metrics, task) == want, task
        assert evaluation.data.metrics[f"data/{task}/bad_files"] == 3
    assert by_reason(evaluation.data.metrics, "digits_zeroshot") == {"undecodable_image": 1, "no_class": 1}
    assert f"data (heldout): {sum(want.values())} samples skipped" in printed
    every = json.loads((out / "skipped.json").read_text())
    keys = {r: sorted(k for _, k in refs) for r, refs in every["heldout"]["samples"].items()}
    assert keys == {r: sorted(f.sample["__key__"] for f in expected["test"].faults if f.reason == r)
                    for r in expected["test"].skipped("caption")}
    # the held-out retrieval embedded every sample with a caption, and nothing else
    embedded = set(pq.read_table(out / "heldout" / "images").column("key").to_pylist())
    assert embedded == expected["test"].delivered("caption")


def test_jobs_embed_embeds_every_good_sample_and_lists_the_rest(faulty, trained, tmp_path, capsys):
    root, expected, _ = faulty
    _, _, run, uri, _, _ = trained
    out = tmp_path / "embed"
    rc = jobs.embed.main(["--model", f"runs:/{run.info.run_id}/model", "--data", str(root), "--split", "train",
                          "--out", str(out), "--actors", "1", "--no-texts", "--tracking-uri", uri])
    printed = capsys.readouterr().out
    assert rc == 0
    exp = expected["train"]
    embedded = pq.read_table(out / "images").column("key").to_pylist()
    assert len(embedded) == len(set(embedded)) and set(embedded) == exp.delivered(None)
    skipped = json.loads((out / "skipped.json").read_text())
    assert {r: len(k) for r, k in skipped["samples"].items()} == dict(exp.skipped(None))
    assert {Path(p).name: (f["reason"], f["kept"]) for p, f in skipped["files"].items()} == exp.files
    assert f"{len(exp.delivered(None))} image embeddings" in printed and "skipped file" in printed
