"""The mutation list: every rule of docs/SCALING.md's guarantees and of the fault-tolerance code, a small patch that
removes it, and the tests that must then fail. `make test-mutants` (`python -m tests.mutants`) applies each patch to a
scratch copy of the checkout, runs its tests there and prints killed / survived; it exits 1 unless every mutant is
killed. A mutant "survives" when its tests still pass: the rule is then unguarded, whatever the docs say.

A rule added to the product gets its mutant here, with the test that catches it. `tests/test_mutants.py` (make
test-fast) checks that each patch still applies to the tree exactly once and that each named test exists, so the list
cannot go stale silently.

    python -m tests.mutants                 # every mutant
    python -m tests.mutants --only replay   # those whose name contains "replay"
    python -m tests.mutants --list          # the list, nothing run
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    path: str  # relative to the checkout
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids: at least one must fail

    def apply(self, root: Path) -> None:
        file = root / self.path
        text = file.read_text()
        if text.count(self.old) != 1:
            raise ValueError(f"{self.name}: the patch's text occurs {text.count(self.old)} times in {self.path}")
        file.write_text(text.replace(self.old, self.new))


MUTANTS = [
    Mutant("replay-per-key",
           "a restart's metrics are dropped as replays per key, not up to the run's highest delivered step",
           "pipelines/tracking/outbox.py",
           "return step >= resumed_from and latest.get(key, -1) >= step",
           "return step >= resumed_from and max(latest.values(), default=-1) >= step",
           ("tests/test_tracking_outage.py::test_a_restart_neither_reads_the_store_nor_logs_a_step_twice",
            "tests/test_pretrain.py::test_a_restart_does_not_write_steps_mlflow_already_has")),
    Mutant("replay-dropped",
           "a restart's replayed steps are dropped, not delivered twice",
           "pipelines/tracking/outbox.py",
           "return step >= resumed_from and latest.get(key, -1) >= step",
           "return False",
           ("tests/test_tracking_outage.py::test_a_restart_neither_reads_the_store_nor_logs_a_step_twice",
            "tests/test_pretrain.py::test_a_restart_does_not_write_steps_mlflow_already_has")),
    Mutant("crc-restored",
           "the snapshot's CRC-32 switch is set back to the process's own after the save",
           "pipelines/zero/checkpoint_files.py",
           "        torch.serialization.set_crc32_options(before)\n",
           "        pass\n",
           ("tests/test_reshard.py::test_the_shards_are_written_without_checksums_and_the_option_is_left_as_it_was",)),
    Mutant("crc-off",
           "the snapshot is written without torch.save's CRC-32 records",
           "pipelines/zero/checkpoint_files.py",
           "    torch.serialization.set_crc32_options(False)\n",
           "    torch.serialization.set_crc32_options(True)\n",
           ("tests/test_reshard.py::test_the_shards_are_written_without_checksums_and_the_option_is_left_as_it_was",)),
    Mutant("core-imports",
           "the stage-neutral training core (pipelines/fit) loads no DeepSpeed",
           "pipelines/fit/loop.py",
           "import time\n",
           "import time\nimport deepspeed  # noqa: F401\n",
           ("tests/test_imports.py::test_the_training_core_loads_no_deepspeed",)),
    Mutant("zero-loads-no-stage",
           "DeepSpeed's pieces for any stage (pipelines/zero) load no stage's module (pretraining's, the digits', ...)",
           "pipelines/zero/fit.py",
           "from models.gather import World\n",
           "from models.gather import World\nimport pipelines.digits.dataset  # noqa: F401\n",
           ("tests/test_imports.py::test_deepspeeds_pieces_load_no_stage",)),
    Mutant("cut-short-removed",
           "a restart removes the checkpoint folders that uploads cut short (never registered) past its step",
           "pipelines/zero/checkpoint_files.py",
           "            fs.rm(path, recursive=True)\n",
           "            pass\n",
           ("tests/test_checkpoint_upload.py::test_a_restart_removes_only_the_uploads_cut_short",)),
    Mutant("cut-short-only",
           "a restart removes only later attempts' folders past its step, never the one it resumed from",
           "pipelines/zero/checkpoint_files.py",
           'if match and int(match["step"]) > resumed_step and int(match["attempt"]) < attempt:',
           'if match and int(match["step"]) >= resumed_step and int(match["attempt"]) < attempt:',
           ("tests/test_checkpoint_upload.py::test_a_restart_removes_only_the_uploads_cut_short",)),
    Mutant("notice-file-taken",
           "a notice file is taken (renamed) by the save it caused: no later attempt reads it again",
           "pipelines/fit/preemption.py",
           '            os.replace(self.file, f"{self.file}.taken")\n',
           "            pass\n",
           ("tests/test_preemption.py::test_notices_at_the_edges_cost_no_step_and_a_notice_file_is_taken_once",)),
    Mutant("notice-file-once",
           "a notice file no newer than the last one taken is no notice (the checkpoint keeps its time)",
           "pipelines/fit/preemption.py",
           "    if st.st_mtime <= taken_mtime:\n        return False\n",
           "",
           ("tests/test_preemption.py::test_a_notice_file_no_newer_than_the_one_taken_is_no_notice",)),
    Mutant("notice-records-persisted",
           "a notice's own records (its tag, preemptions, preemption_save_s) go to the run's storage before its "
           "wait: a restart during an outage delivers them",
           "pipelines/fit/notices.py",
           "            self.logger.persist_more(self.outbox_folder)\n        if evaluate:  # after the save",
           "        if evaluate:  # after the save",
           ("tests/test_tracking_outage.py::test_a_preemption_during_a_tracking_outage_loses_nothing",)),
    Mutant("notice-records-beside",
           "a notice's own records are added beside the queue its save wrote, not the queue written again",
           "pipelines/tracking/outbox.py",
           "        if self.persisted is None or self.persisted[0] != target:\n            return self.persist(target)\n",
           "        return self.persist(target)\n",
           ("tests/test_outbox_memory.py::"
            "test_a_saves_own_records_are_added_beside_the_queue_it_wrote_not_written_again",)),
    Mutant("outbox-streamed",
           "the queue handed over with a checkpoint is written a call at a time, never read whole into memory",
           "pipelines/tracking/outbox.py",
           "        mark, ops = self._undelivered(0)\n",
           "        mark, ops = self._undelivered(0)\n        ops = list(ops)\n",
           ("tests/test_outbox_memory.py::test_a_long_outages_queue_is_handed_over_and_taken_back_a_call_at_a_time",)),
    Mutant("evaluation-stops-for-a-notice",
           "a notice on any rank during an evaluation between steps stops it: the evaluation's step is saved at once",
           "pipelines/pretrain/step_evaluation.py",
           "                                               self.notices.evaluation_stop(step) if stoppable else None)",
           "                                               None)",
           ("tests/test_preemption.py::"
            "test_a_notice_during_an_evaluation_stops_it_and_saves_the_evaluation_step",)),
    Mutant("released-at-once",
           "at the end of a run with the store away, rank 0 hands its queue over and is released at once",
           "pipelines/tracking/outbox.py",
           "                if while_reachable and self.down_since is not None:\n                    break\n",
           "",
           ("tests/test_tracking_outage.py::"
            "test_what_a_store_that_never_returns_missed_is_kept_in_order_and_delivered_later",)),
    Mutant("one-upload-in-flight",
           "a periodic save behind training first waits for the previous upload to be registered: one in flight",
           "pipelines/zero/checkpoints.py",
           "        checkpoint_files.wait_for_uploads(previous, self.t.upload_timeout_s)\n        self.upload = None\n",
           "        self.upload = None\n",
           ("tests/test_checkpoint_upload.py::"
            "test_an_upload_held_keeps_training_a_notice_then_waits_for_it_and_a_kill_during_one_resumes_from_the_one_before",)),
    Mutant("outbox-first-in-every-save",
           "every save (periodic, a notice's, the final one) hands rank 0's undelivered metrics to the run's storage "
           "first, before its snapshot: a node lost hard after any checkpoint during an outage costs no metric",
           "pipelines/zero/checkpoints.py",
           "        if self.logger:  # 1\n            self.logger.persist(self.outbox_folder)\n",
           "",
           ("tests/test_outbox_handover.py::test_a_node_lost_hard_during_an_outage_loses_no_metric",)),
    Mutant("guard-at-start",
           "attempts that a notice ends before their first step, past run.max_notices_without_progress in a row, stop "
           "the run with one line (NoticeLoop) instead of restarting for ever",
           "pipelines/fit/notices.py",
           "        self.guard(step)\n",
           "",
           ("tests/test_guard_notice_loop.py::"
            "test_attempts_that_a_notice_ends_before_their_first_step_stop_the_run_and_no_other_loss_does",)),
    Mutant("guard-counts-notices-only",
           "an attempt lost before its first step to anything but a notice (a node, a storage error) is a failure "
           "(run.max_failures), not a notice loop",
           "pipelines/fit/attempts.py",
           "                or notices(journal.folder, entry) is None:\n",
           "                or False:\n",
           ("tests/test_attempts.py::test_attempts_a_notice_ended_without_a_step_are_counted_until_another_one",
            "tests/test_guard_notice_loop.py::"
            "test_attempts_that_a_notice_ends_before_their_first_step_stop_the_run_and_no_other_loss_does",)),
    Mutant("guard-start-notice-recorded",
           "a notice seen before an attempt's first step is recorded in the run's storage (an attempt whose machine "
           "goes before it trains is known to have ended by a notice)",
           "pipelines/fit/notices.py",
           "                if self.notice.pending():\n                    attempts.record_notice(self.folder, self.attempt,",
           "                if False:\n                    attempts.record_notice(self.folder, self.attempt,",
           ("tests/test_guard_notice_loop.py::"
            "test_attempts_that_a_notice_ends_before_their_first_step_stop_the_run_and_no_other_loss_does",)),
    Mutant("records-whole-only",
           "a failure or notice record a kill cut short mid-write (the atomic write's temporary file beside it) is "
           "passed over by every reader: the driver's one line, the restart's line and the guard's count",
           "pipelines/storage.py",
           ' and base.endswith(".json")]',
           "]",
           ("tests/test_attempts.py::test_a_record_a_kill_cut_short_is_not_read",)),
    Mutant("final-notice-remembered",
           "a notice file seen after the final checkpoint is recorded as taken in the run's storage: a restart does "
           "not take it for a notice again where renaming it failed",
           "pipelines/fit/notices.py",
           "max(progress.notice_file_mtime, attempts.taken_file_mtime(self.folder))",
           "progress.notice_file_mtime",
           ("tests/test_preemption.py::test_notices_at_the_edges_cost_no_step_and_a_notice_file_is_taken_once",)),
    Mutant("save-at-once-registered",
           "a save at once (a notice's, the final one) returns only once Ray Train registered it (COMMITTED)",
           "pipelines/zero/checkpoint_files.py",
           "            wait_for_uploads(progress.step, upload_timeout_s)\n",
           "            pass\n",
           ("tests/test_registered_notice_save.py::test_a_notices_save_returns_only_once_ray_train_registered_it",)),
    Mutant("upload-wait-bounded",
           "a wait for a checkpoint's registration ends after train.upload_timeout_s: an upload stuck on one rank fails "
           "the attempt in one line (UploadTimeout) instead of holding every rank at the next save for ever",
           "pipelines/fit/registered.py",
           "COMMITTED,\n                                           timeout_s=timeout_s)\n",
           "COMMITTED)\n",
           ("tests/test_upload_wait.py::test_the_wait_passes_its_bound_to_ray_and_a_wait_that_long_is_an_error",
            "tests/test_upload_wait.py::test_an_upload_that_never_ends_fails_the_attempt_after_the_timeout")),
    Mutant("snapshot-within-cgroup",
           "a snapshot goes to /dev/shm only where the room under the process's cgroup memory limit holds it too (a "
           "container's limit below the host's memory: $TMPDIR, said in one line)",
           "pipelines/zero/checkpoint_files.py",
           "    if min(free, available_memory()) >= need:\n",
           "    if min(free, host_available_memory()) >= need:\n",
           ("tests/test_snapshot_memory.py::"
            "test_a_container_limit_below_the_need_sends_the_snapshot_to_disk_while_the_host_has_room",)),
    Mutant("restart-reads-nothing",
           "a restart never reads the store: its logger starts without a call to MLflow (a store that hangs would "
           "hold it)",
           "pipelines/tracking/logger.py",
           "            head, ops = carried or ({}, [])\n",
           "            try:\n                from mlflow import MlflowClient\n                MlflowClient(uri).get_run(run_id)\n"
           "            except Exception:\n                pass\n            head, ops = carried or ({}, [])\n",
           ("tests/test_store_hangs.py::test_a_restart_logs_every_step_while_the_store_holds_its_one_request",
            "tests/test_tracking_outage.py::test_a_restart_neither_reads_the_store_nor_logs_a_step_twice")),
    Mutant("loop-never-waits",
           "a step's log call only queues: the loop never calls the store itself",
           "pipelines/tracking/logger.py",
           "        if self.outbox:\n            self.outbox.put_metrics(",
           "        if self.outbox:\n            try:\n                self.client.log_batch(\n"
           "                    self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])\n"
           "                return\n            except Exception:\n                pass\n            self.outbox.put_metrics(",
           ("tests/test_store_hangs.py::test_a_restart_logs_every_step_while_the_store_holds_its_one_request",
            "tests/test_tracking_outage.py::"
            "test_what_a_store_that_never_returns_missed_is_kept_in_order_and_delivered_later")),
    Mutant("unreachable-as-measured",
           "tracking_unreachable_s is the time the store was away, handed over with the queue",
           "pipelines/tracking/outbox.py",
           "        seconds = round(unreachable_s, 1)",
           "        seconds = round(unreachable_s + 1, 1)",
           ("tests/test_tracking_outage.py::"
            "test_what_a_store_that_never_returns_missed_is_kept_in_order_and_delivered_later",)),
    Mutant('file-gone',
           'an artifact whose queued copy is gone is set aside, not retried forever',
           'pipelines/tracking/outbox.py',
           '    if isinstance(err, FileNotFoundError) and "file" in op and not (files / op["file"]).exists():\n        return REFUSED\n',
           '',
           ('tests/test_outbox_answers.py::test_an_artifact_whose_copy_is_gone_is_set_aside_not_retried_forever',)),
    Mutant('413-split',
           "a batch over a proxy's body limit (413) is split until it passes",
           'pipelines/tracking/outbox.py',
           '    if status == 413:\n        return TOO_LARGE\n',
           '',
           ('tests/test_outbox_answers.py::test_batches_over_a_proxys_body_limit_are_split_until_they_pass',)),
    Mutant('json-refusal',
           "only MLflow's own JSON refusal of a call is a refusal: a proxy's 4xx page is an outage",
           'pipelines/tracking/outbox.py',
           '    if isinstance(err, RestException) and err.json.get("error_code") in STORE_REFUSALS:\n        return REFUSED\n',
           '',
           ('tests/test_outbox_answers.py::test_a_call_the_store_refuses_is_set_aside_and_never_replayed',)),
    Mutant('4xx-page-outage',
           "a proxy's 404/401/403 page in front of the store is an outage, retried, not a refusal",
           'pipelines/tracking/outbox.py',
           '    return OUTAGE\n\n\ndef metrics_op',
           '    if status is not None and 400 <= status < 500 and status not in (408, 429):\n        return REFUSED\n    return OUTAGE\n\n\ndef metrics_op',
           ('tests/test_outbox_answers.py::test_an_answer_that_is_not_the_stores_refusal_is_an_outage',)),
    Mutant('duplicate-reread',
           'a refused batch of metrics the store already holds (a late duplicate) is delivered',
           'pipelines/tracking/outbox.py',
           '            if not any(_kept({**op, "filtered": False, "event": False}, {"latest": latest}) for op in batch):',
           '            if False:',
           ('tests/test_outbox_answers.py::test_a_batch_held_past_the_clients_timeout_and_delivered_twice_is_not_a_refusal',)),
    Mutant('refusal-bisect',
           'a refused batch of metrics is halved until the refused ones are alone: the rest is delivered',
           'pipelines/tracking/outbox.py',
           '            else:\n                self.probe = size // 2\n',
           '            else:\n                self._set_aside(batch, err)\n                return True\n',
           ('tests/test_outbox_answers.py::test_a_call_the_store_refuses_is_set_aside_and_never_replayed',)),
    Mutant('refused-persisted',
           "the calls the store refused travel to the run's storage (refused.jsonl), never replayed",
           'pipelines/tracking/outbox.py',
           '    keep_refused(target, refused)\n    fs, root = fs_path(target)\n',
           '    fs, root = fs_path(target)\n',
           ('tests/test_outbox_answers.py::test_a_call_the_store_refuses_is_set_aside_and_never_replayed',)),
    Mutant('error-text-hidden',
           "the errors the outbox prints and keeps hide the store URI's credentials",
           'pipelines/tracking/outbox.py',
           '    return hide_credentials(f"{type(err).__name__}: {text[0][:300] if text else \'\'}")',
           '    return f"{type(err).__name__}: {text[0][:300] if text else \'\'}"',
           ('tests/test_secrets.py::test_the_outbox_never_prints_nor_keeps_the_password_of_a_store_that_is_away',)),
    Mutant("replay-latest-grows",
           "what the outbox delivers counts as the store's: a record a restart makes again (a notice's evaluation) "
           "after an earlier attempt's handed-over copy lands once",
           "pipelines/tracking/outbox.py",
           "            latest[key] = max(latest.get(key, -1), step)\n",
           "            pass\n",
           ("tests/test_tracking_outage.py::"
            "test_a_record_made_again_by_a_restart_lands_once_and_its_own_events_all_land",)),
    Mutant("events-not-replays",
           "an attempt's own events (a save's seconds, a notice) inside the replay window are delivered",
           "pipelines/tracking/outbox.py",
           'if op.get("filtered") or op.get("event"):',
           'if op.get("filtered"):',
           ("tests/test_tracking_outage.py::"
            "test_a_record_made_again_by_a_restart_lands_once_and_its_own_events_all_land",)),
    Mutant("failure-queued",
           "a failed job's FAILED status is queued after what rank 0 left and kept when the store is away: the job's "
           "error is never held by the store",
           "pipelines/tracking/runs.py",
           "            run.fail()\n",
           '            finish_run(uri, run.run_id, "FAILED")\n',
           ("tests/test_outbox_answers.py::"
            "test_a_job_that_fails_while_the_store_hangs_fails_at_once_and_its_failed_status_is_kept",)),
    Mutant("loop-config-private",
           "the store's URI and the config reach the workers by reference, never in the loop config Ray Train keeps",
           "pipelines/fit/trainer.py",
           '{PRIVATE: secret, "mlflow_run_id": self.mlflow_run_id,',
           '{PRIVATE: secret, "mlflow_uri": self.mlflow_uri, "mlflow_run_id": self.mlflow_run_id,',
           ("tests/test_secrets.py::test_no_secret_reaches_a_log_a_run_or_rays_state_through_an_outage_a_failure_and_a_resume",)),
    Mutant("config-artifact-redacted",
           "a resume's config artifact keeps no credential",
           "pipelines/tracking/runs.py",
           "    return reopen(MlflowClient(uri), run_id, redact_yaml(config_yaml), key)",
           "    return reopen(MlflowClient(uri), run_id, config_yaml, key)",
           ("tests/test_secrets.py::test_no_secret_reaches_a_log_a_run_or_rays_state_through_an_outage_a_failure_and_a_resume",)),
    Mutant("no-run-links",
           "MLflow's run link, printed with the URI as given, is off for a URI with credentials",
           "pipelines/tracking/store.py",
           '        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"',
           '        pass',
           ("tests/test_secrets.py::test_no_secret_reaches_a_log_a_run_or_rays_state_through_an_outage_a_failure_and_a_resume",)),
    Mutant("summary-hidden",
           "the run's summary names the store without its credentials",
           "pipelines/pretrain/run_summary.py",
           "    shown = hide_credentials(result.mlflow_uri)",
           "    shown = result.mlflow_uri",
           ("tests/test_secrets.py::test_no_secret_reaches_a_log_a_run_or_rays_state_through_an_outage_a_failure_and_a_resume",)),
    Mutant("notice-train-on",
           "after a notice's save the workers train on where the deadline leaves room, not wait for the restart",
           "pipelines/fit/notices.py",
           "        if not self._train_on(taken_at + left, save_s, p.step):\n",
           "        if True:\n",
           ("tests/test_elastic.py::test_elastic_run_saves_on_notice_shrinks_and_grows_back",)),
    Mutant("last-save-reserved",
           "training on after a notice, the last save starts early enough to be registered before the deadline",
           "pipelines/fit/notices.py",
           "        reserve = 2 * save_s + 2 * self.step_s + NOTICE_MARGIN_S\n",
           "        reserve = 0.0\n",
           ("tests/test_elastic.py::test_elastic_run_saves_on_notice_shrinks_and_grows_back",)),
    Mutant("compat-said-at-start",
           "a private name of an untested Ray that no longer holds is said in one line at the job's start",
           "pipelines/compat/__init__.py",
           "    for problem in found:\n",
           "    for problem in []:\n",
           ("tests/test_compat.py::test_a_job_says_at_its_start_what_an_untested_ray_breaks",)),
    Mutant("resume-without-store",
           "a new command on a run's storage finds its MLflow run there, not by asking the store",
           "pipelines/tracking/runs.py",
           "    recorded = _recorded_run(record_in)\n",
           "    recorded = None\n",
           ("tests/test_tracking_outage.py::"
            "test_a_resume_with_the_store_away_trains_without_it_and_reopens_the_run_later",)),
    Mutant("resume-reopening-queued",
           "a resume that finds the store away hands the run's reopening to rank 0 and trains on",
           "pipelines/tracking/runs.py",
           "        add_to_pending(pending_in, recorded, uri, [{\"reopen\": redact_yaml(config_yaml), \"key\": key}])\n",
           "        raise\n",
           ("tests/test_tracking_outage.py::"
            "test_a_resume_with_the_store_away_trains_without_it_and_reopens_the_run_later",)),
    Mutant("reopen-idempotent",
           "a resume's reopening done twice (its try cut short by an outage, then its queued copy) counts once",
           "pipelines/tracking/outbox.py",
           "    attempt = done[0] if done else int(tags.get(RESUMES_TAG, \"0\")) + 1\n",
           "    attempt = int(tags.get(RESUMES_TAG, \"0\")) + 1\n",
           ("tests/test_tracking_outage.py::"
            "test_a_resume_reopened_twice_by_its_try_and_its_queued_copy_counts_once",)),
    Mutant("notice-reached-trained-on",
           "a restart after training on counts the steps since the notice's save that it runs again",
           "pipelines/fit/attempts.py",
           "max(notice[\"step\"],\n",
           "min(notice[\"step\"],\n",
           ("tests/test_attempts.py::test_a_restart_after_training_on_knows_the_steps_it_runs_again",)),
    Mutant("register-idempotent",
           "registering a run's model again (a timed-out call delivered twice) makes no second version",
           "pipelines/tracking/outbox.py",
           "    if made:\n        return str(min(int(v.version) for v in made))\n",
           "",
           ("tests/test_tracking_outage.py::test_registering_a_runs_model_again_makes_no_second_version",)),
    # the adapter's rank 0 logs through the outbox (pipelines.fit.step_log): the outbox's replay rule is what drops the
    # steps a restart trains again; the adapter's resumed_from only bounds it from below (without it, 0 drops the same)
    Mutant("adapter-outbox",
           "the adapter's fit outlives a tracking outage: rank 0 logs through the outbox, so neither its loop nor a "
           "restart waits for the store",
           "pipelines/fit/step_log.py",
           "resumed_from=resumed_from, background=True,",
           "resumed_from=resumed_from,",
           ("tests/test_probvlm.py::test_a_restarted_fit_logs_each_step_once",)),
    Mutant("adapter-notices",
           "the adapter's fit takes notices of preemption as pretraining's does (the core's Notices): a save at the "
           "step, the file taken, the restart resumed there",
           "pipelines/adapt/loop.py",
           "    fit.voters = (notices,)\n",
           "",
           ("tests/test_probvlm.py::test_a_restarted_fit_logs_each_step_once",)),
    Mutant("stale-snapshots-at-start",
           "a job's driver removes killed uploads' snapshots on every node before its workers start, not only where a "
           "later training worker starts",
           "pipelines/zero/snapshot_sweep.py",
           "            choice): node for node in self.names}",
           "            choice): node for node in ()}",
           ("tests/test_stale_snapshots.py::test_a_job_removes_killed_uploads_snapshots_before_its_workers_start",)),
    Mutant("stale-snapshots-each-node",
           "the sweep of killed uploads' snapshots runs on each node, pinned there, not wherever Ray places it",
           "pipelines/zero/snapshot_sweep.py",
           "task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(\n            choice)",
           "task.remote(\n            choice)",
           ("tests/test_stale_snapshots.py::"
            "test_every_node_removes_its_own_and_a_node_that_does_not_answer_is_skipped",)),
    Mutant("texts-of-one-batch-here",
           "texts that fit one batch are embedded by the caller's model, not by an actor pool started for them",
           "pipelines/evaluate/inference.py",
           "return model is not None and len(texts) <= opts.batch_size",
           "return False",
           ("tests/test_evaluation.py::"
            "test_texts_that_fit_one_batch_are_embedded_by_the_callers_model_without_a_pool",)),
    Mutant("no-idle-dataset-manager",
           "a run given no Ray dataset starts no DatasetManager actor (one process an attempt fewer)",
           "pipelines/compat/ray_private.py",
           "            if self.datasets:\n                return callbacks",
           "            if True:\n                return callbacks",
           ("tests/test_bad_shards.py::test_training_on_faulty_shards_finishes_and_counts_every_fault[trained]",)),
    Mutant("download-without-torch",
           "a download task imports img2dataset without torch (webdataset's PyTorch classes, never used there)",
           "pipelines/download/shard.py",
           'with without("torch"):',
           "if True:",
           ("tests/test_worker_imports.py::test_a_download_task_imports_no_torch",)),
    Mutant("ray-workers-collect-less",
           "every Ray worker of a job runs with CPython's collector tuned for start-up (its imports ~15% cheaper)",
           "pipelines/cluster/runtime.py",
           "    collect_less()\n    quiet_logs()",
           "    quiet_logs()",
           ("tests/test_gc_tuning.py::test_every_ray_worker_runs_with_the_tuned_collector",)),
    Mutant("job-driver-collects-less",
           "a job's driver runs its main with CPython's collector tuned for start-up",
           "jobs/cli.py",
           "        collect_less()  # before",
           "        pass  # before",
           ("tests/test_gc_tuning.py::test_a_jobs_main_runs_with_the_tuned_collector",)),
]


def scratch_copy(dest: Path) -> None:
    """The checkout's tracked and untracked files (not those git ignores: .venv, caches, state) under `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(root: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, list[str], str]:
    """pytest over `tests` in `root`, whose packages shadow the checkout's (PYTHONPATH, and the working directory
    that tests/conftest.py and Ray's workers put first); its exit status, the tests it names as failed (read from its
    whole report: Ray's lines on stderr can outgrow any tail) and its output's tail."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
           "-m", "not gpu", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, failed_tests(partial), partial[-2000:]
    return out.returncode, failed_tests(out.stdout), (out.stdout + out.stderr)[-3000:]


def failed_tests(report: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", report, flags=re.M)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="print the list and run nothing")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one mutant's tests")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:22s} {m.path}: {m.rule}\n{'':22s} killed by {', '.join(m.tests)}")
        return 0
    rows, start = [], time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="probvlp_mutants_"))
    try:
        pristine = base / "pristine"
        scratch_copy(pristine)
        # the scratch copy, not the checkout, is what the tests import
        probe = subprocess.run([sys.executable, "-c", "import pipelines; print(pipelines.__file__)"], cwd=pristine,
                               env={**os.environ, "PYTHONPATH": str(pristine)}, capture_output=True, text=True)
        if not probe.stdout.strip().startswith(str(pristine)):
            print(f"the scratch copy does not shadow the checkout: pipelines is {probe.stdout.strip()}")
            return 2
        for m in chosen:
            tree = base / m.name
            shutil.copytree(pristine, tree)
            m.apply(tree)
            began = time.monotonic()
            rc, failed, output = run_tests(tree, m.tests, args.timeout)
            verdict = "killed" if rc == 1 else "survived" if rc == 0 else f"error (pytest exit {rc})"
            rows.append((m, verdict, failed, time.monotonic() - began))
            print(f"{m.name}: {verdict} in {rows[-1][3]:.0f} s{': ' + ', '.join(rows[-1][2]) if rows[-1][2] else ''}",
                  flush=True)
            if verdict != "killed":
                print(output[-1500:], flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n| mutant | rule removed | file | verdict | failed test | s |\n|---|---|---|---|---|---|")
    for m, verdict, failed, seconds in rows:
        print(f"| {m.name} | {m.rule} | {m.path} | {verdict} | {', '.join(failed) or '-'} | {seconds:.0f} |")
    killed = sum(v == "killed" for _, v, _, _ in rows)
    print(f"\n{killed} of {len(rows)} mutants killed in {time.monotonic() - start:.0f} s")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
