"""The outbox's queue at rest, through an outage of any length: what rank 0 hands over with each checkpoint (`persist`)
and what a restart takes back (`load`) are streamed a call at a time, never read whole into memory (a long outage
spills its queue to a file on rank 0's node: pipelines/tracking/outbox.py). Measured by the Python heap's peak
(tracemalloc) against the size of the file written or read; no server: the store is a port that answers nothing,
so nothing leaves the queue meanwhile."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from pipelines.tracking import outbox as outbox_module
from pipelines.tracking.outbox import PENDING, Outbox, load, metrics_op
from tests.helpers import free_port

CALLS, PER_CALL = 1500, 100  # 150,000 metrics: ~5 MB of JSON


@pytest.fixture
def spilled(monkeypatch, tmp_path):
    """An outbox whose store is away, with CALLS calls queued, all but the first few in its spill file."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(outbox_module, "MEMORY_METRICS", 5 * PER_CALL)
    uri = f"http://127.0.0.1:{free_port()}"
    box = Outbox(MlflowClient(uri), "0" * 32, uri, tmp_path / "node")
    for call in range(CALLS):
        box.put_metrics([Metric(f"metric_{k}", float(call), 1_000 + call, call) for k in range(PER_CALL)])
    yield box
    box.close(0, 0.0, keep_to=str(tmp_path / "closed"), summary=False)


def peak(action) -> int:
    """The heap's peak, in bytes above what it held before, while `action()` runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        action()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_long_outages_queue_is_handed_over_and_taken_back_a_call_at_a_time(spilled, tmp_path):
    assert spilled.spill.stat().st_size > 4_000_000  # the queue is on disk, not in memory
    storage = tmp_path / "storage"

    written = []
    used = peak(lambda: written.append(spilled.persist(str(storage))))
    size = (storage / PENDING).stat().st_size
    assert written == [CALLS] and size > 4_000_000
    assert used < size / 20, f"persist held {used / 1e6:.1f} MB for a {size / 1e6:.1f} MB queue"

    head, kept = load(str(storage), tmp_path / "files")
    counted = [0, 0]

    def take_back() -> None:
        for op in kept:
            counted[0] += 1
            counted[1] += len(op["metrics"])

    used = peak(take_back)
    assert counted == [CALLS, CALLS * PER_CALL] and head["run_id"] == "0" * 32
    assert used < size / 20, f"load held {used / 1e6:.1f} MB for a {size / 1e6:.1f} MB queue"
    # the queue as it was, in order
    steps = [op["metrics"][0][3] for op in load(str(storage), Path(tmp_path / "files"))[1]]
    assert steps == list(range(CALLS))


def test_a_saves_own_records_are_added_beside_the_queue_it_wrote_not_written_again(spilled, tmp_path):
    """A notice's save writes the queue (persist), then its own few records (`persist_more`): they go to a small file
    beside it, pending.jsonl stays as written, and a restart reads both, in order; the next whole persist replaces
    both. The driver's reopening of a run (`add_to_pending`) goes the same way."""
    from pipelines.tracking.outbox import MORE, add_to_pending

    storage = tmp_path / "storage"
    assert spilled.persist(str(storage)) == CALLS
    written = (storage / PENDING).read_bytes()
    spilled.put({"tag": ["probvlp.preemption.step_7", "{}"]})
    spilled.put_metrics([Metric("preemptions", 1.0, 2_000, 7)], event=True)
    assert spilled.persist_more(str(storage)) == 2
    assert (storage / PENDING).read_bytes() == written  # not written again
    [more] = storage.glob(MORE.format(id="*"))
    assert len(more.read_text().splitlines()) == 2
    assert add_to_pending(str(storage), "0" * 32, "http://unused", [{"reopen": "a: 1"}]) == 1
    assert (storage / PENDING).read_bytes() == written
    ops = list(load(str(storage), tmp_path / "files")[1])
    assert len(ops) == CALLS + 3 and ops[CALLS]["tag"][0] == "probvlp.preemption.step_7"
    assert ops[CALLS + 1]["metrics"][0][0] == "preemptions" and ops[CALLS + 2] == {"reopen": "a: 1"}
    # the next save's whole persist holds everything not delivered, and the added file goes
    assert spilled.persist(str(storage)) == CALLS + 2
    assert not list(storage.glob(MORE.format(id="*")))
    assert len(list(load(str(storage), tmp_path / "files")[1])) == CALLS + 2


@pytest.mark.slow
def test_the_queue_and_a_saves_records_travel_through_object_storage(monkeypatch, tmp_path, s3):
    """On S3 (the tests' server), as on a cluster: the queue, a save's records added beside it, and a driver's
    reopening after them, read back whole and in order by another process (a fresh filesystem: no cached listing),
    then replaced by the next whole persist."""
    import s3fs

    from pipelines.tracking.outbox import MORE, add_to_pending
    from tests.helpers import BUCKET

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{free_port()}"
    box = Outbox(MlflowClient(uri), "1" * 32, uri, tmp_path / "node")
    try:
        for call in range(20):
            box.put_metrics([Metric("loss", float(call), 1_000 + call, call)])
        target = f"s3://{BUCKET}/outbox-{tmp_path.name}"
        assert box.persist(target) == 20
        box.put({"tag": ["probvlp.preemption.step_19", "{}"]})
        assert box.persist_more(target) == 1
        assert add_to_pending(target, "1" * 32, uri, [{"reopen": "a: 1"}]) == 1

        def read_back() -> list[dict]:
            s3fs.S3FileSystem.clear_instance_cache()  # another node's process
            return list(load(target, tmp_path / f"files-{len(tmp_path.name)}")[1])

        ops = read_back()
        assert [op["metrics"][0][3] for op in ops[:20]] == list(range(20))
        assert ops[20]["tag"][0] == "probvlp.preemption.step_19" and ops[21] == {"reopen": "a: 1"}
        box.put_metrics([Metric("loss", 20.0, 1_020, 20)])
        assert box.persist(target) == 22
        assert len(read_back()) == 22
        assert not s3.glob(f"{BUCKET}/outbox-{tmp_path.name}/{MORE.format(id='*')}")
    finally:
        box.close(0, 0.0, keep_to=str(tmp_path / "closed"), summary=False)
