"""Checkpoints uploaded behind training (pipelines.zero.checkpoint_files): the loop goes on while an upload is in flight and
waits at the next save (one upload at a time); a kill during an upload resumes from the checkpoint before and ends
bit for bit as an uninterrupted run; a checkpoint due by one rank's clock is saved by every rank at the same step; a
cluster run that never checkpoints says so."""
from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from mlflow import MlflowClient

from pipelines.pretrain.config import TrainConfig
from pipelines.pretrain.job import without_checkpoints
from tests.helpers import pretrain_beside, registered, wait_for
from tests.pace import scaled
from tests.small_runs import REFERENCE, assert_identical, config, load_state
from tests.test_preemption import audited, journal, train_workers

HELD_STEP = 10  # REFERENCE checkpoints every 5 steps: the upload of step 10 is held, step 15's save waits for it
KILL_HELD_STEP = 25  # the second attempt's upload of step 25 held too, step 30's save waiting for it: then the kill


def test_an_upload_held_keeps_training_a_notice_then_waits_for_it_and_a_kill_during_one_resumes_from_the_one_before(
        ray_local, straight_small_run, tmp_path):
    """The test holds rank 0's upload of the step-10 checkpoint (the file it uploads to in the run's storage is a
    named pipe nobody reads: its open blocks): the loop trains steps 11-15 meanwhile, then the step-15 save waits for
    it (the journal says so) and no step after 15 runs. A notice of preemption comes then (the hook's file, no time
    left) and the upload is let go: the notice is seen at step 16, whose save follows the uploads before it (ordered:
    10, 15, then 16, each registered) and the restart resumes there. In that attempt the upload of step 25 is held
    the same way and a worker killed while the step-30 save waits for it: the restart resumes from step 20, the last
    checkpoint whose upload was whole (step 25's was never registered; the restart removes its folder). Counted by the
    steps each attempt applied (run.audit_steps_to): none lost, only the kill's repeated; MLflow has every step, the
    ones up to the kill's checkpoint once; the run ends bit for bit on an uninterrupted run's state (REFERENCE)."""
    audit, storage, notice = tmp_path / "steps.txt", tmp_path / "ray", tmp_path / "notice"
    cfg = config(tmp_path, straight_small_run["data_root"], "held", *REFERENCE, "train.log_every=1",
                 "run.max_failures=1", f"run.audit_steps_to={audit}", f"run.notice_file={notice}",
                 "run.keep_checkpoints=8")  # every registration stays listed: their order is checked
    held, held_again = (storage / "held" / f"checkpoint_{step:08d}_attempt{attempt:03d}" / "state" /
                        "mp_rank_00_model_states.pt" for step, attempt in ((HELD_STEP, 1), (KILL_HELD_STEP, 2)))
    seen: dict = {}
    released: set = set()

    def waiting_for(step: int) -> list[dict]:
        return [a for a in journal(storage, "held") if a.get("waiting_for_upload") == step]

    def hold_notice_release_then_kill() -> None:
        try:
            wait_for("the run's first step", lambda: audited(audit).get(1), 300, 0.05)
            for fifo in (held, held_again):
                fifo.parent.mkdir(parents=True)
                os.mkfifo(fifo)
            before = audited(audit)[1]
            assert before[-1] < HELD_STEP, f"the run reached step {before[-1]} before the test held its upload"
            # (or the loop past 16: it did not wait, two uploads in flight; said at once, not after the wait's bound)
            wait_for("the step-15 save waiting for the upload of step 10",
                     lambda: waiting_for(HELD_STEP) or audited(audit)[1][-1] > HELD_STEP + 6, 120, 0.1)
            assert waiting_for(HELD_STEP), (f"the loop reached step {audited(audit)[1][-1]} without waiting for the "
                                            f"upload of step {HELD_STEP}: two uploads in flight")
            # the loop stays at step 15 while that upload cannot end: watched for five of its own steps' time (a
            # loop that went on, two uploads in flight, trains step 16 within one)
            times = [float(line.split()[2]) for line in audit.read_text().splitlines()]
            step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
            time.sleep(min(5 * step_s, scaled(30)))
            seen["after_wait"] = audited(audit)[1][-1]
            seen["registered"] = registered(storage / "held")
            notice.write_text("0\n")  # a notice while a save waits on an upload in flight; no time left
            release(held)
            released.add(held)
            # (or the loop past 31: it did not wait, and the final save would wait for the held upload for ever)
            wait_for("the step-30 save waiting for the upload of step 25",
                     lambda: waiting_for(KILL_HELD_STEP) or audited(audit).get(2, [0])[-1] > 31, 300, 0.1)
            seen["after_wait_again"] = audited(audit)[2][-1]
            seen["registered_again"] = registered(storage / "held")
            os.kill(wait_for("two training workers", lambda: len(p := train_workers()) == 2 and p, 60, 0.1)[0],
                    signal.SIGKILL)
        except BaseException:
            for fifo in {held, held_again} - released:  # a held upload would keep the run waiting for ever
                release(fifo)  # (a pipe already read to its end has no writer left: its reader would wait for ever)
            raise

    result = pretrain_beside(cfg, hold_notice_release_then_kill)
    ran = audited(audit)
    # steps 11-15 trained while the upload of 10 could not end, none after 15 until it did; the notice's save at 16;
    # the kill's attempt held at the save of 30 (one upload in flight), its steps after 20 applied again
    assert ran == {1: list(range(1, 17)), 2: list(range(17, 31)), 3: list(range(21, 41))}, ran
    assert seen["registered"][-1] == "checkpoint_00000005_attempt001" and seen["after_wait"] == 15, seen
    assert seen["after_wait_again"] == 30, seen
    attempts = journal(storage, "held")
    assert [a["from_step"] for a in attempts] == [0, 16, 20], attempts
    assert attempts[0]["notice"] == {"step": 16, "sources": ["file"]}, attempts[0]
    # the notice's save registered after the uploads before it, the one it waited for included
    names = [f"checkpoint_{s:08d}_attempt001" for s in (5, HELD_STEP, 15, 16)]
    assert seen["registered_again"] == names + ["checkpoint_00000020_attempt002"], seen
    # never registered, and removed by the restart (an upload cut short is nobody's checkpoint)
    assert held_again.parent.parent.name not in registered(storage / "held")
    assert not held_again.parent.parent.exists()
    client = MlflowClient(result.mlflow_uri)
    logged = Counter(m.step for m in client.get_metric_history(result.mlflow_run_id, "loss"))
    assert sorted(logged) == list(range(1, 41)) and all(logged[s] == 1 for s in range(1, 21)), logged
    assert result.metrics["step"] == 40
    assert assert_identical(load_state(result.checkpoint_path), load_state(straight_small_run["checkpoint"])) > 20


def release(fifo) -> None:
    """Read the held file's pipe to its end in a thread of its own: the upload that writes into it goes through."""
    def drain() -> None:
        with open(fifo, "rb") as f:
            while f.read(1 << 20):
                pass

    if fifo.exists():
        threading.Thread(target=drain, daemon=True).start()


class Vote:
    """A voter of pipelines.fit.step.agree: this rank's vote, what the ranks agreed."""

    def __init__(self, mine: bool):
        self.mine, self.agreed = mine, None

    def vote(self) -> bool:
        return self.mine


def _agree_on(rank: int, port: int, cases: list[dict], out) -> None:
    from models.gather import World
    from pipelines.fit.step import agree

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = World.current()
        got = []
        for case in cases:
            loss = torch.tensor(float("nan") if rank in case["nan_on"] else 1.0)
            notice, clock = Vote(rank in case["notice_on"]), Vote(rank in case["clock_on"])
            got.append((agree(loss, world, (notice, clock)), notice.agreed, clock.agreed))
        out.put((rank, got))
    finally:
        torch.distributed.destroy_process_group()


def test_a_checkpoint_due_by_one_ranks_clock_is_saved_by_every_rank_at_that_step():
    """Each rank's clock of train.checkpoint_every_s runs on its own; the step's all-reduce joins them: due on one
    rank is due on both, at that step (two gloo processes), beside the loss's finiteness and the notice."""
    cases = [{"nan_on": (), "notice_on": (), "clock_on": ()},
             {"nan_on": (), "notice_on": (), "clock_on": (1,)},
             {"nan_on": (0,), "notice_on": (1,), "clock_on": (0,)},
             {"nan_on": (), "notice_on": (0,), "clock_on": (0, 1)}]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_on, args=(rank, port, cases, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    expected = [(True, False, False), (True, False, True), (False, True, True), (True, True, True)]
    assert results == {0: expected, 1: expected}


@pytest.mark.parametrize("every, every_s, spans, warned", [
    (0, 0, True, True), (0, 0, False, False), (100, 0, True, False), (0, 600, True, False)])
def test_a_cluster_run_without_checkpoints_says_so_in_one_line(every, every_s, spans, warned):
    line = without_checkpoints(TrainConfig(checkpoint_every=every, checkpoint_every_s=every_s), spans)
    assert (line is not None) == warned
    if warned:
        assert "\n" not in line and "train.checkpoint_every_s" in line and "lost node" in line


def test_a_restart_removes_only_the_uploads_cut_short(tmp_path):
    """At attempt 3's start, resumed from step 20: the folders of earlier attempts past step 20 were never registered
    (a restart resumes from the latest that was) and go; the one it resumed from, earlier ones, this attempt's and
    anything not named by pipelines.zero.checkpoint_files stay."""
    from pipelines.zero.checkpoint_files import checkpoint_name, remove_cut_short

    names = {checkpoint_name(10, 1): "stays", checkpoint_name(20, 1): "stays", checkpoint_name(30, 1): "goes",
             checkpoint_name(30, 2) + "_2": "goes", checkpoint_name(40, 3): "stays", "checkpoint_2026-11-29_08-00-00.1":
             "stays", "probvlp": "stays"}
    for name in names:
        (tmp_path / name / "state").mkdir(parents=True)
        (tmp_path / name / "state" / "x.pt").write_bytes(b"x")
    removed = remove_cut_short(str(tmp_path), 20, 3)
    assert removed == sorted(n for n, fate in names.items() if fate == "goes")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, fate in names.items() if fate == "stays")
    assert remove_cut_short(str(tmp_path / "absent"), 0, 1) == []


def test_the_snapshot_goes_to_memory_where_a_checkpoint_fits_twice_else_to_the_temporary_folder(tmp_path):
    """train.checkpoint_snapshot_dir "auto": /dev/shm when its free bytes and the memory available hold 16 bytes a
    parameter (weights and AdamW's moments, the whole checkpoint) twice over, else $TMPDIR; a folder given is used as
    given."""
    import shutil
    import tempfile
    from types import SimpleNamespace

    from pipelines.zero.checkpoint_files import SHM, snapshot_root

    def engine(params: int):
        return SimpleNamespace(module=torch.nn.Linear(params, 1, bias=False))

    assert snapshot_root(engine(10), str(tmp_path)) == str(tmp_path)
    assert snapshot_root(engine(10)) == (SHM if os.path.isdir(SHM) else tempfile.gettempdir())
    if os.path.isdir(SHM):
        fits = shutil.disk_usage(SHM).free // 32
        assert snapshot_root(SimpleNamespace(module=SimpleNamespace(parameters=lambda: [
            SimpleNamespace(ds_numel=fits + 1, numel=lambda: 0)]))) == tempfile.gettempdir()
