"""Resharding a ZeRO checkpoint to another data-parallel world size (elastic training at ZeRO-1/2/3).

DeepSpeed loads ZeRO-1/2/3 optimizer partitions only at the world size that saved them. When an elastic run restarts
at another size, the last checkpoint is converted once into DeepSpeed's universal format (one folder per parameter
holding its whole fp32 master weight and Adam moments: ``deepspeed.checkpoint.ds_to_universal``), which any world size
loads (``checkpoint.load_universal``). The universal folder is written inside the checkpoint's own folder, on the run's
storage (local or object storage), so it is shared by every node and deleted with its checkpoint
(``run.keep_checkpoints``). It counts only once its marker exists: an interrupted conversion leaves at most a partial
folder without marker, which the next attempt replaces; the checkpoint's own files are only ever read.
"""
from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
from pathlib import Path

from pipelines.compat.deepspeed_private import convert_to_universal, loading_universal_checkpoint

UNIVERSAL = "universal"  # the converted folder, inside the checkpoint folder
MARKER = "universal.json"  # written last: the conversion is complete
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_world_size(tag_dir: Path) -> int | None:
    """The data-parallel world size whose ZeRO-1/2/3 partitions `tag_dir` holds (one optimizer file per rank); None
    for a stage-0 checkpoint (one whole optimizer state, loadable at any size)."""
    if not tag_dir.is_dir():
        return None
    ranks = {int(m.group(1)) for p in tag_dir.iterdir() if (m := _OPTIM_FILE.match(p.name))}
    return len(ranks) or None


def convert(tag_dir: Path, out_dir: Path) -> None:
    """The universal form of the ZeRO checkpoint in `tag_dir` into `out_dir`/<tag>/ (ds_to_universal in-process, one
    worker: the training workers' CPUs are the only ones there are). Our model carries no tensor-parallel layout, so
    the checkpoint lacks DeepSpeed's universal_checkpoint_info; inject_missing_state writes its default (no TP)."""
    convert_to_universal(tag_dir, out_dir / tag_dir.name)


def ensure_universal(fs, base: str, local_dir: Path, tag: str) -> dict:
    """Rank 0: the universal folder of the checkpoint at `base` on the fsspec filesystem `fs`, converted from
    `local_dir`/`tag` (the checkpoint's files as this worker sees them) unless its marker says that was done. Returns
    the marker's record."""
    from pipelines.storage import read_json, write_bytes_atomic

    done = read_json(fs, f"{base}/{MARKER}")
    if done is not None:
        return done
    dest = f"{base}/{UNIVERSAL}"
    if fs.exists(dest):  # a conversion that stopped before its marker
        fs.rm(dest, recursive=True)
    source = local_dir / tag
    record = {"from_world_size": saved_world_size(source)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probvlp-universal-") as tmp:
        convert(source, Path(tmp))
        record["convert_s"] = round(time.perf_counter() - t0, 2)
        record["bytes"] = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        fs.put(f"{tmp}/", f"{dest}/", recursive=True)
    record["total_s"] = round(time.perf_counter() - t0, 2)
    write_bytes_atomic(fs, f"{base}/{MARKER}", json.dumps(record).encode())
    return record


@contextlib.contextmanager
def universal_dir(fs, base: str, local_dir: Path):
    """The checkpoint's universal folder as a local directory: in place where the checkpoint is one already, else a
    temporary copy from storage."""
    if (local_dir / MARKER).exists():
        yield local_dir / UNIVERSAL
        return
    with tempfile.TemporaryDirectory(prefix="probvlp-universal-") as tmp:
        fs.get(f"{base}/{UNIVERSAL}/", f"{tmp}/", recursive=True)
        yield Path(tmp)


def load(engine, fs, base: str, local_dir: Path, tag: str) -> tuple[str | None, dict | None, dict | None]:
    """engine.load_checkpoint of the checkpoint at `base` (its files in `local_dir`), through its universal form when
    it was saved at another data-parallel world size (collective). Returns DeepSpeed's (load path, client state) and
    the conversion's record (None when the checkpoint loaded as saved)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = saved_world_size(local_dir / tag)
    if saved is None or saved == world:
        return *engine.load_checkpoint(str(local_dir), tag=tag), None
    record = [ensure_universal(fs, base, local_dir, tag) if not dist.is_initialized() or dist.get_rank() == 0
              else None]
    if world > 1:  # also the barrier: the others read the folder once rank 0 has written it
        dist.broadcast_object_list(record, src=0)
    with universal_dir(fs, base, local_dir) as folder:
        with loading_universal_checkpoint(engine):  # read at load time only; saving is unchanged
            path, client_state = engine.load_checkpoint(str(folder), tag=tag)
    return path, client_state, {**record[0], "to_world_size": world}
