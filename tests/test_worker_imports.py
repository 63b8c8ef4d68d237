"""What a worker's process imports: every Ray Train worker imports pipelines.pretrain.worker first, and every download
task img2dataset's downloader, writer and resizer, so each package in them costs CPU-seconds per worker per run
(benchmarks/startup.py)."""
from __future__ import annotations

import subprocess
import sys

from tests.small_runs import ROOT
from tests.pace import scaled

# Packages of other stages or of optional integrations the libraries try: none belongs in a training worker. MLflow
# is rank 0's alone, imported when it builds its logger.
NOT_IN_A_WORKER = ("wandb", "img2dataset", "mlflow", "pipelines.download", "pipelines.tune", "pipelines.adapt")


def test_a_training_worker_imports_no_other_stage_and_no_unused_integration():
    code = ("import sys, pipelines.pretrain.worker; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_IN_A_WORKER!r} "
            f"or any(m == p or m.startswith(p + '.') for p in {NOT_IN_A_WORKER!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=scaled(120)).stdout.strip().splitlines()[-1]
    assert out == "[]", f"a training worker imports {out}"


def test_a_download_task_imports_no_torch():
    """img2dataset's shard writer (webdataset) imports torch when it is there; a download task never uses it."""
    code = ("import sys; from pipelines.download.shard import _img2dataset; _img2dataset(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=scaled(120)).stdout.strip().splitlines()[-1]
    assert out == "[]", f"a download task imports {out}"
