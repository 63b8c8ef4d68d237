"""What `jobs.pretrain` prints at the end (pipelines/pretrain/run_summary.py), read from a run's final metrics and artifacts.
The whole summary of a real ProLIP run is checked in tests/test_methods.py (`make test-long`)."""
from __future__ import annotations

from types import SimpleNamespace

from pipelines.config import EvalTask
from pipelines.evaluate.headline import headline
from pipelines.pretrain.run_summary import plot_lines, uncertainty_lines

LEVELS = ["instance", "specific", "mid", "general"]
TASKS = [EvalTask(name="digits_zeroshot", kind="zeroshot"), EvalTask(name="heldout", kind="retrieval")]


def test_sigma2_by_caption_level_comes_from_the_logged_analyses():
    metrics = {f"heldout/unc_level_{lv}_sigma2": 0.001 * (i + 1) for i, lv in enumerate(LEVELS)}
    metrics.update({"heldout/unc_level_rho": 0.5, "heldout/image_sigma2_mean": 0.0005,
                    "heldout/unc_caption_wider_frac": 0.9, "digits_zeroshot/top1": 0.9})
    lines = uncertainty_lines(metrics, TASKS)
    assert "'heldout'" in lines[0]
    rows = [line.split() for line in lines[1:5]]  # one per level, in the task's order (specific -> general)
    assert [r[0] for r in rows] == LEVELS and [float(r[1]) for r in rows] == [0.001, 0.002, 0.003, 0.004]
    assert lines[5].split()[:2] == ["images", "0.0005"] and "90% of the pairs" in lines[5]
    assert "rho(level, sigma^2) +0.50 here, the mean rising level by level" in lines[6] and len(lines) == 7
    # the demo's digits: sigma^2 falls from the class captions to the general ones; the line says why
    metrics.update({"heldout/unc_level_general_sigma2": 0.0015, "heldout/unc_level_rho": -0.31})
    line = uncertainty_lines(metrics, TASKS)[6]
    assert "-0.31 here, the means not rising" in line and "labelled negative" in line and "RESULTS.md" in line
    # a positive rho alone (many instance captions below the class ones) does not make the order
    metrics["heldout/unc_level_rho"] = 0.29
    assert "+0.29 here, the means not rising" in uncertainty_lines(metrics, TASKS)[6]
    # a deterministic model's run has no sigma^2 metrics: nothing printed
    assert uncertainty_lines({"digits_zeroshot/top1": 0.9, "heldout/rsum": 300.0}, TASKS) == []


def test_plots_are_listed_where_the_sqlite_store_keeps_them(tmp_path):
    result = SimpleNamespace(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", mlflow_run_id="abc")
    assert plot_lines(result) == ["plots: plots/ in the run's artifacts (abc, mlflow ui)"]  # none written
    folder = tmp_path / "mlartifacts" / "abc" / "artifacts" / "plots"
    folder.mkdir(parents=True)
    for name in ("heldout_analyses.png", "heldout_analyses.json", "digits_zeroshot_uncertainty.png"):
        (folder / name).write_bytes(b"")
    lines = plot_lines(result)
    assert lines[0].endswith(f"{folder}/") and "sigma^2 bin" in lines[0] and "caption level" in lines[0]
    assert lines[1:] == ["  digits_zeroshot_uncertainty.png", "  heldout_analyses.png"]


def test_headline_says_n_a_where_a_calibration_is_undefined():
    metrics = {"heldout/i2t_R1": 0.25, "heldout/t2i_R1": 0.0, "heldout/rsum": 19.14, "heldout/i2t_calib_score": 0.2,
               "heldout/t2i_calib_score": float("nan"), "heldout/image_sigma2_mean": 1e-4, "heldout_loss/loss": 7.1}
    lines = headline(metrics)
    assert lines[:2] == ["  heldout: i2t_R1 0.25, t2i_R1 0, rsum 19.14, i2t_calib_score 0.2, t2i_calib_score n/a",
                         "  heldout_loss: loss 7.1"]
    assert "same in every sigma^2 bin" in lines[2] and len(lines) == 3
    metrics["heldout/t2i_calib_score"] = -0.1
    assert len(headline(metrics)) == 2 and "n/a" not in " ".join(headline(metrics))
