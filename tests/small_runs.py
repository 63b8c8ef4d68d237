"""The small demo-model runs that the scale, autoscaling and elastic tests share, and bit-exact comparison of
their DeepSpeed checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

from pipelines.pretrain.config import load_train_config
from pipelines.compat.deepspeed_private import checkpoint_safe_globals

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.overrides.vision_depth=1", "model.overrides.text_depth=1", "train.batch_size=32",
         "train.warmup_steps=2", "eval.batch_size=512", "data.mid_caption_prob=0", "data.general_caption_prob=0",
         "data.augment=false"]

# The knobs that decide the weights of the runs compared bit for bit (test_scale, test_autoscaling) with
# conftest's straight_small_run: ZeRO-1 (optimiser state partitioned; ZeRO-3's flat fp32 partitions end in padding
# that DeepSpeed leaves uninitialised, so its checkpoints differ in bytes that hold no weight), seeded data in file
# order, 40 steps with a checkpoint every 5 (time to stop, fail or lose a node between two of them), each step two
# micro-batches of feature-cache accumulation (train.grad_accum: a resume continues the epoch at a step's first
# micro-batch; a worker's 19 batches an epoch make some steps span two epochs).
REFERENCE = ["train.steps=40", "train.checkpoint_every=5", "data.deterministic=true", "train.zero_stage=1",
             "train.grad_accum=2"]


def config(tmp, digits_root, name, *extra):
    return load_train_config(ROOT / "configs" / "demo.yaml", [
        f"data.root={digits_root}", f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"run.storage_path={tmp}/ray",
        f"run.name={name}", "run.experiment=test-scale", *SMALL, *extra,
    ])


def load_state(checkpoint_dir: str) -> dict[str, object]:
    """Every tensor-bearing file of a DeepSpeed checkpoint, loaded weights-only."""
    files = sorted(Path(checkpoint_dir).rglob("*.pt"))
    assert files, f"no DeepSpeed files in {checkpoint_dir}"
    with torch.serialization.safe_globals(checkpoint_safe_globals()):
        return {f.name: torch.load(f, weights_only=True) for f in files}


def assert_identical(a, b, path="") -> int:
    """Recursive bit-exact comparison; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
        return 1
    if isinstance(a, dict):
        assert set(a) == set(b), path
        return sum(assert_identical(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return sum(assert_identical(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    return 0


def audited(path) -> dict[int, list[tuple[int, float]]]:
    """The optimizer steps each attempt of a run applied, as rank 0 wrote them (run.audit_steps_to): attempt -> [(step,
    time.time() once applied)], in order. What a restart trained twice shows here, not in MLflow, which drops replays
    before they reach it."""
    steps: dict[int, list[tuple[int, float]]] = {}
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        attempt, step, at = line.split()
        steps.setdefault(int(attempt), []).append((int(step), float(at)))
    return steps


# What the loop logs at every step besides the loss's parts (pipelines.pretrain.step_metrics): each of them, and
# every other key logged at most steps, must be in MLflow at every step.
STEP_KEYS = {"loss", "lr", "samples_per_s", "epoch", "contrastive_batch", "skipped_batches", "world_size",
             "data_wait_frac", "data_wait_ms", "data/train/skipped_frac", "data/train/skipped", "data/train/bad_files"}


def every_step_once(client, run_id: str, last: int, stopped_at: tuple[int, ...] = ()) -> None:
    """Every key a step logs (those MLflow holds at more than half the steps: the loss and its parts, lr, throughput,
    data wait and skips; not a checkpoint's, a notice's or the end's) is in MLflow at every step 1..`last`, once:
    the end's data report logs the training set's counts once more at the last step, and at each step of
    `stopped_at` where a command stopped early (train.stop_at_step)."""
    history = {key: sorted(m.step for m in client.get_metric_history(run_id, key))
               for key in client.get_run(run_id).data.metrics}
    step_keys = {key for key, steps in history.items() if len(set(steps)) > last // 2}
    assert STEP_KEYS <= step_keys, f"logged at few steps or not at all: {sorted(STEP_KEYS - step_keys)}"
    for key in sorted(step_keys):
        steps = history[key]
        missing = sorted(set(range(1, last + 1)) - set(steps))
        ends = {last, *stopped_at} if key.startswith("data/train/") else set()
        twice = sorted({s for s in steps if steps.count(s) > 1} - ends)
        assert not missing and not twice and set(steps) <= set(range(1, last + 1)), \
            f"{key}: steps missing {missing[:10]}, logged twice {twice[:10]}"
