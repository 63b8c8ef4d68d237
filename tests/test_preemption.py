"""Notices of preemption on one node (pipelines.fit.preemption): the hook's file, the budget Ray Train counts a
preemption against, and SIGTERM to a training worker on the shared local Ray, which saves at the next step on every
rank and resumes there. A drain by Ray (reason PREEMPTION) of a node that then goes needs nodes of their own: the
multi-node tier, tests/test_elastic.py, where a notice with room to train on is shown (the drain's deadline)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from mlflow import MlflowClient

from pipelines.fit import preemption
from pipelines.fit.preemption import NOTICE_FILE_ENV, Notice
from tests.helpers import Hold, pretrain_beside, registered, wait_for
from tests.small_runs import REFERENCE, assert_identical, config, load_state


def test_the_hooks_file_is_a_notice_with_its_deadline(no_notice, tmp_path, monkeypatch):
    """$PROBVLP_PREEMPTION_NOTICE_FILE: nothing while the file is absent; once written (the seconds left), a notice
    from "file" whose deadline is counted from the file's time; notify() adds a source of its own."""
    path = tmp_path / "notice"
    monkeypatch.setenv(NOTICE_FILE_ENV, str(path))
    notice = Notice(sigterm_grace_s=None)
    assert not notice.pending()
    path.write_text("120\n")
    os.utime(path, (time.time() - 20, time.time() - 20))  # written 20 s ago
    assert notice.pending()
    taken = notice.take()
    assert taken["sources"] == ["file"] and 99 < taken["deadline_in_s"] <= 100
    preemption.notify("slurm USR1", deadline_s=10)
    taken = notice.take()
    assert taken["sources"] == ["file", "slurm USR1"] and 9 < taken["deadline_in_s"] <= 10


def test_a_notice_file_no_newer_than_the_one_taken_is_no_notice(no_notice, tmp_path):
    """A notice file that its save could not take away (renamed) stays on the node: a worker handed the time of the
    last file taken (from the checkpoint) ignores a file that old, and sees a newer one again."""
    path = tmp_path / "notice"
    path.write_text("0\n")
    written = os.stat(path).st_mtime
    assert not Notice(sigterm_grace_s=None, taken_file_mtime=written, file=str(path)).pending()
    os.utime(path, (written + 5, written + 5))  # written again after the one taken
    assert Notice(sigterm_grace_s=None, taken_file_mtime=written, file=str(path)).pending()


def test_a_preemption_has_its_own_budget(tmp_path):
    """run.max_preemptions reaches Ray Train's FailureConfig beside run.max_failures; unlimited (-1) by default."""
    from pipelines.fit.trainer import torch_trainer

    def failure_config(*settings):
        cfg = config(tmp_path, str(tmp_path), "budget", *settings)
        return torch_trainer(lambda c: None, {}, cfg, {}).run_config.failure_config

    default = failure_config()
    assert (default.max_failures, default.max_preemption_failures) == (0, -1)
    set_both = failure_config("run.max_failures=2", "run.max_preemptions=5")
    assert (set_both.max_failures, set_both.max_preemption_failures) == (2, 5)


def train_workers() -> list[int]:
    """The pids of the training workers alive on the shared local Ray."""
    import ray
    from ray.util.state import list_actors

    alive = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    # named: other Rays may run on this machine
    return sorted(a.pid for a in list_actors(ray.get_runtime_context().gcs_address, filters=alive, detail=True))


@pytest.mark.long
def test_a_deadline_shorter_than_the_save_resumes_from_the_last_complete_checkpoint(ray_local, straight_small_run,
                                                                                     no_notice, tmp_path):
    """SIGTERM, then SIGKILL a moment later (a grace period shorter than the save: the machine goes during it). A
    checkpoint counts only once every rank's part is in (Ray Train registers it when every rank's ray.train.report
    has returned), so the restart resumes from one that was registered, whole (REFERENCE's every 5 steps, or the
    notice's if it finished first), and the run ends bit for bit as an uninterrupted one. Rank 0 is held in the final
    evaluation (a Hold) until the kill is done: however fast the run, it cannot end before the worker is killed."""
    data = straight_small_run["data_root"]
    cfg = config(tmp_path, data, "short", *REFERENCE, "train.log_every=1", "run.max_failures=1", "run.sigterm_grace_s=0")
    seen: list[list[str]] = []
    end = Hold(tmp_path / "hold")

    def terminate_a_worker() -> None:
        try:
            folder = tmp_path / "ray" / "short"
            wait_for("the first checkpoint registered", lambda: registered(folder), 300, 0.2)
            pids = wait_for("two training workers", lambda: len(pids := train_workers()) == 2 and pids, 60, 0.2)
            os.kill(pids[-1], signal.SIGTERM)
            time.sleep(0.3)
            os.kill(pids[-1], signal.SIGKILL)
            while train_workers() == pids:  # the restart replaces both
                seen.append(registered(folder))
                time.sleep(0.05)
        except BaseException as error:
            seen.append(error)

    result = pretrain_beside(cfg, terminate_a_worker, holds=(end,))
    assert not any(isinstance(s, BaseException) for s in seen), seen
    run = MlflowClient(result.mlflow_uri).get_run(result.mlflow_run_id)
    resumed = int(run.data.tags["probvlp.resumed_from_step"])
    noticed = [a["notice"]["step"] for a in journal(tmp_path / "ray", "short") if "notice" in a]
    assert resumed % 5 == 0 or resumed in noticed  # a periodic checkpoint, or the notice's if it was registered
    assert result.metrics["step"] == 40 and run.info.status == "FINISHED"
    assert assert_identical(load_state(result.checkpoint_path), load_state(straight_small_run["checkpoint"])) > 20
    print(f"notice at step {noticed}, resumed from {resumed}; registered before the restart: {seen[-1] if seen else []}")


def audited(path) -> dict[int, list[int]]:
    """The optimizer steps each attempt applied (run.audit_steps_to): attempt -> its steps in order."""
    steps: dict[int, list[int]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        attempt, step, _ = line.split()
        steps.setdefault(int(attempt), []).append(int(step))
    return steps


def journal(storage, name: str) -> list[dict]:
    from pipelines.storage import load_json, run_folder

    return load_json(f"{run_folder(str(storage), name)}/attempts.json") or []


def test_notices_at_the_edges_cost_no_step_and_a_notice_file_is_taken_once(ray_local, straight_small_run, no_notice,
                                                                           tmp_path):
    """The hook's file is there before the run starts (a notice before step 1, at an evaluation step: every step is
    one here): both ranks save at step 1, then evaluate, then wait for Ray Train's restart (a preemption: with
    run.max_failures=0 the run still ends well), which resumes at step 1; the file is taken by that save (renamed),
    so the restart trains on instead of saving again. The file appears again during the final evaluation (after the
    final checkpoint), which rank 0 is held in (a Hold) until Ray Train's restart has come: the notice is seen there
    whatever the evaluation's speed, and the restart only evaluates and saves the model. That file cannot be renamed
    (its `.taken` name is a folder): its time, recorded in the run's storage, keeps the restart from taking it for a
    notice again, so the run ends after three attempts instead of looping into NoticeLoop. Counted by the steps each
    attempt applied (run.audit_steps_to): every step exactly once; MLflow holds every step's metrics once, the
    evaluation's too; and the run ends bit for bit on an uninterrupted run's state (REFERENCE)."""
    notice, audit, steps = tmp_path / "notice", tmp_path / "steps.txt", 40
    notice.write_text("0\n")  # the seconds left: none (a notice read after its deadline still gets its save)
    # the digits' zero-shot task alone: an evaluation at each of the 40 steps, none of them more than it needs
    only_zeroshot = ('eval.tasks=[{name: digits_zeroshot, kind: zeroshot, data: "{data.root}/eval/zeroshot", '
                     'templates: "{data.root}/eval/zeroshot/prompts.json"}]')
    cfg = config(tmp_path, straight_small_run["data_root"], "edges", *REFERENCE, "train.eval_every=1", only_zeroshot,
                 "train.log_every=1", "run.max_failures=0", "run.sigterm_grace_s=2", f"run.notice_file={notice}",
                 f"run.audit_steps_to={audit}")

    final_evaluation = Hold(tmp_path / "hold")  # rank 0 stops there until the notice's restart has come

    def notice_in_the_final_evaluation() -> None:
        wait_for("rank 0 in the final evaluation", final_evaluation.held, 300, 0.1)
        assert any(a.get("checkpoint_step") == steps for a in journal(tmp_path / "ray", "edges")), \
            "rank 0 was in the final evaluation before the final checkpoint"
        # the first notice's file was taken (renamed); this one cannot be: its name is taken by a folder
        (tmp_path / "notice.taken").unlink()
        (tmp_path / "notice.taken").mkdir()
        (tmp_path / "notice.taken" / "keep").write_text("")
        notice.write_text("1\n")  # a second left
        # the restart comes while rank 0 is still held in the evaluation; pretrain_beside releases it once this returns
        wait_for("the restart after the notice in the final evaluation",
                 lambda: len(journal(tmp_path / "ray", "edges")) >= 3, 300, 0.1)

    result = pretrain_beside(cfg, notice_in_the_final_evaluation, holds=(final_evaluation,))
    ran = audited(audit)
    assert ran == {1: [1], 2: list(range(2, steps + 1))}, ran  # every step once; the third attempt trains nothing
    attempts = journal(tmp_path / "ray", "edges")
    assert [a["from_step"] for a in attempts] == [0, 1, steps], attempts
    assert final_evaluation.held() == 2  # attempt 2, which the restart ended there, and attempt 3, which went on
    assert attempts[0]["notice"]["step"] == 1 and attempts[0]["notice"]["sources"] == ["file"]
    # the final notice's file stayed (its rename failed), and no restart took it for a notice again
    assert notice.exists() and (tmp_path / "notice.taken" / "keep").exists()
    client = MlflowClient(result.mlflow_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and result.metrics["step"] == steps
    for key in ("loss", "digits_zeroshot/top1"):  # a step logged twice would show twice
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == \
            list(range(1, steps + 1)), key
    lost = client.get_metric_history(run.info.run_id, "preemption_steps_lost")
    assert sorted((m.step, m.value) for m in lost) == [(1, 0), (steps, 0)]
    final = json.loads(run.data.tags["probvlp.attempt.3"])
    # its sources are rank 0's: the file, or (when another rank took the file first and Ray's restart reached rank 0
    # before its watcher did) the SIGTERM of that restart
    assert final["resumed_from_step"] == steps and final["why"].startswith("a notice of preemption (")
    assert final["why"].endswith(f"at step {steps}") and final["steps_again"] == 0
    assert "digits_zeroshot/top1" in result.metrics
    assert assert_identical(load_state(result.checkpoint_path), load_state(straight_small_run["checkpoint"])) > 20


# The fault tier (make test-cluster, run alone): a SIGTERM and a restart, with the other tier's time budget in mind
@pytest.mark.slow
@pytest.mark.cluster
def test_a_notice_during_an_evaluation_stops_it_and_saves_the_evaluation_step(ray_local, digits_root, no_notice,
                                                                              tmp_path):
    """SIGTERM to the rank that is not rank 0 while rank 0 evaluates step 10 (held there by a Hold until the rank has
    recorded its notice in the run's storage, whatever the machine's speed): rank 0 reads it before its next batch,
    stops the evaluation and both ranks save step 10 at once, evaluate it after the save and wait for the restart,
    which resumes at step 10. Counted by the steps each attempt applied: 1-10, then 11-40, none twice; MLflow holds
    step 10's evaluation once. Without the stop, the notice would wait for the evaluation's end and be saved at
    step 11."""
    from pipelines.storage import run_folder
    from pipelines.fit.faults import EVALUATION, held_file, released_file

    audit, steps = tmp_path / "steps.txt", 40
    only_zeroshot = ('eval.tasks=[{name: digits_zeroshot, kind: zeroshot, data: "{data.root}/eval/zeroshot", '
                     'templates: "{data.root}/eval/zeroshot/prompts.json"}]')
    cfg = config(tmp_path, digits_root, "eval-notice", *REFERENCE, "train.eval_every=10",
                 "train.checkpoint_every=1000", only_zeroshot, "train.log_every=1", "run.max_failures=0",
                 "run.sigterm_grace_s=3", f"run.audit_steps_to={audit}")
    evaluation = Hold(tmp_path / "hold", EVALUATION)
    records = run_folder(str(tmp_path / "ray"), "eval-notice") + "/notices"

    def notice_during_the_first_evaluation() -> None:
        wait_for("rank 0 in the evaluation of step 10", evaluation.held, 300, 0.1)
        rank0 = int(held_file(evaluation.folder, EVALUATION).read_text().split()[0])
        [other] = [pid for pid in train_workers() if pid != rank0]
        os.kill(other, signal.SIGTERM)
        wait_for("the other rank's notice recorded", lambda: os.path.isdir(records) and any(
            name.endswith("-evaluation.json") for name in os.listdir(records)), 60, 0.1)
        released_file(evaluation.folder, EVALUATION, 1).touch()  # this stop only: later evaluations go on

    result = pretrain_beside(cfg, notice_during_the_first_evaluation, holds=(evaluation,))
    attempts = journal(tmp_path / "ray", "eval-notice")
    assert [a["from_step"] for a in attempts] == [0, 10], attempts
    assert attempts[0]["notice"] == {"step": 10, "sources": ["SIGTERM"]}, attempts[0]
    assert audited(audit) == {1: list(range(1, 11)), 2: list(range(11, steps + 1))}
    client = MlflowClient(result.mlflow_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and result.metrics["step"] == steps
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "digits_zeroshot/top1")) == \
        [10, 20, 30, steps]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, steps + 1))
