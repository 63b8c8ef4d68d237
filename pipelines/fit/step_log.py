"""Rank 0's MLflow logger of a fit on Ray Train, built so that the fit outlives its tracking store: what it logs goes
through an outbox (pipelines.tracking.outbox) that a thread delivers while the store answers, and what it has not
delivered travels with the run in its storage (`pipelines.storage.outbox_folder`), not with the node. The stage's
worker does the rest, in the one order of every save: `logger.persist(folder)` before each checkpoint, again as an
attempt fails, and `logger.close(keep_to=folder)` at the end, after which the driver delivers what is left
(`Launch.run(pending_in=folder)`). Pretraining's workers and the adapter's build their logger here."""
from __future__ import annotations

from pipelines.tracking import StepLogger
from pipelines.tracking.logger import process_outbox
from pipelines.tracking.outbox import files_folder, load


def rank0_logger(uri: str, run_id: str, resumed_from: int, flush_timeout_s: float, folder: str) -> StepLogger:
    """The attempt's logger: the calls an earlier attempt left in `folder` are delivered first (their metrics after
    `resumed_from`, the checkpoint this attempt resumed from, are left out: it logs those steps again), and of its own
    replayed steps those the store holds are dropped once it answers. Neither the restart nor the loop ever waits for
    the store (no read of the run here: a restart during an outage trains on); the end waits for delivery up to
    `flush_timeout_s`, and only while the store answers when handing over to `folder`."""
    # the carried calls' artifact copies go where this process's outbox (StepLogger's) keeps its own
    files = files_folder(process_outbox(run_id))
    return StepLogger(uri, run_id, None, resumed_from=resumed_from, background=True, flush_timeout_s=flush_timeout_s,
                      carried=load(folder, files, resumed_from, drop_ends=True))
