"""The bundled digits written for the jobs that use them: webdataset shards, eval sets and the adapter's pairs.

The digits take the same path as a user's URL table: the images are written to a folder, served by
`http.server` on 127.0.0.1 (ephemeral port, a thread), listed in one URL table per split (url,
caption, and label / split / captions / digit_index as extra columns that land in each sample's
json), and downloaded by `pipelines.download.job` (img2dataset on Ray tasks) into
{root}/{split}/NNNNN.tar webdataset shards. Every job on the digits calls `prepare_digits` on its driver; on a
cluster that spans nodes the readers send these local files through Ray (`pipelines.data.tars`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipelines.cluster.file_server import LoopbackServer
from pipelines.cluster.runtime import init_ray
from pipelines.download.config import DownloadConfig
from pipelines.data.reader import shard_paths
from pipelines.data.tars import iter_tar_samples, write_tar
from pipelines.digits.dataset import (EVAL_TEMPLATES, NAMES, SPLITS, iter_digits, retrieval_captions,
                                      specific_captions)
from pipelines.download.job import download_shards
from pipelines.download.summary import format_summary


def prepare_digits(root: str | Path, image_size: int = 32, shard_size: int = 500, seed: int = 0, *,
                   keep_written: bool = False) -> dict[str, Path]:
    """The shards under {root}/{split} (`write_digit_shards`) and the eval sets under {root}/eval
    (`write_digit_eval_sets`); the defaults are the demo's. keep_written: shards already written under `root` stay,
    whatever their parameters. Returns the eval sets' folders."""
    if not (keep_written and digit_shards_written(root)):
        write_digit_shards(root, image_size=image_size, shard_size=shard_size, seed=seed)
    return write_digit_eval_sets(root)


def write_url_tables(root: str | Path, image_size: int, seed: int, base_url: str) -> dict[str, Path]:
    """Images under {root}/_source/images (served as {base_url}/images/...) and one parquet URL table per split."""
    source = Path(root) / "_source"
    images = source / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for sample in iter_digits(image_size, seed):
        name = f"{sample.key}.png"
        if not (images / name).exists():
            sample.image.save(images / name, format="PNG")  # lossless; img2dataset encodes the jpg
        rows[sample.split].append({
            "url": f"{base_url}/images/{name}", "caption": specific_captions(sample.label)[0],
            "label": sample.label, "split": sample.split, "captions": sample.meta["captions"],
            "digit_index": int(sample.key),
        })
    tables = {}
    for split, items in rows.items():
        tables[split] = source / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(items), tables[split])
    return tables


def digit_shards_marker(root: str | Path) -> Path:
    """The file `write_digit_shards` writes last under `root`: its parameters and counts. What is derived from
    the shards (eval sets, adapter pairs) keeps a copy of its text to know when to redo itself."""
    return Path(root) / "_SUCCESS.json"


def digit_shards_written(root: str | Path) -> bool:
    """Whether `write_digit_shards` has finished writing under `root` (whatever its parameters were)."""
    return digit_shards_marker(root).exists()


def write_digit_shards(root: str | Path, image_size: int = 32, shard_size: int = 500, seed: int = 0) -> dict[str, int]:
    """Serve the digits on 127.0.0.1 and download them into {root}/{split}/NNNNN.tar. Idempotent.

    Skips everything when an earlier call with the same parameters completed. An interrupted call is
    redone from scratch (the URLs carry the server's ephemeral port, so an old plan cannot be resumed).
    Starts (and afterwards stops) a local Ray unless one is running.
    """
    root = Path(root)
    marker = digit_shards_marker(root)
    wanted = {"image_size": image_size, "shard_size": shard_size, "seed": seed, "via": "img2dataset", "captions": 2}
    if marker.exists() and json.loads(marker.read_text()).get("params") == wanted:
        return json.loads(marker.read_text())["counts"]
    marker.unlink(missing_ok=True)
    for stale in [root / "_source", *(root / s for s in SPLITS)]:
        shutil.rmtree(stale, ignore_errors=True)
    (root / "_source").mkdir(parents=True, exist_ok=True)

    own_ray = not ray.is_initialized()
    if own_ray:
        init_ray()
    counts = {}
    try:
        with LoopbackServer(root / "_source") as server:
            tables = write_url_tables(root, image_size, seed, server.base_url)
            for split in SPLITS:
                cfg = DownloadConfig(
                    input=str(tables[split]), output=str(root / split), additional_columns=["label", "split", "captions",
                                                                                            "digit_index"],
                    image_size=image_size, resize_mode="border", encode_format="jpg", rows_per_shard=shard_size,
                    threads_per_task=16, disallowed_header_directives=[], compute_hash=None, part_timeout_s=600,
                )
                summary = download_shards(cfg, local_only=True, log=lambda *_: None)
                if summary["written"] != summary["input_rows"]:
                    raise RuntimeError(f"digits {split}: not every image was written\n{format_summary(summary)}")
                counts[split] = summary["written"]
    finally:
        if own_ray:
            ray.shutdown()
    marker.write_text(json.dumps({"params": wanted, "counts": counts}))
    return counts


def write_digit_eval_sets(root: str | Path, splits=("val", "test")) -> dict[str, Path]:
    """{root}/eval/zeroshot (classnames.txt, zeroshot_classification_templates.txt, prompts.json with the
    exact class prompts of training, {split}/0.tar with jpg + cls) and {root}/eval/retrieval ({split}/0.tar
    with jpg + txt, two captions a line each). Idempotent: redone only when the shards changed."""
    root = Path(root)
    out = {"zeroshot": root / "eval" / "zeroshot", "retrieval": root / "eval" / "retrieval"}
    source = digit_shards_marker(root).read_text()
    marker = root / "eval" / "_SUCCESS.json"
    if marker.exists() and marker.read_text() == source:
        return out
    for split in splits:
        zs, ret = [], []
        for sample in iter_tar_samples(shard_paths(str(root), split)):
            meta = json.loads(sample["json"])
            zs.append({"__key__": sample["__key__"], "jpg": sample["jpg"], "cls": str(meta["label"]).encode()})
            ret.append({"__key__": sample["__key__"], "jpg": sample["jpg"],
                        "txt": "\n".join(retrieval_captions(meta)).encode()})
        for kind, samples in (("zeroshot", zs), ("retrieval", ret)):
            write_tar(out[kind] / split / "0.tar", samples)
            (out[kind] / split / "nshards.txt").write_text("1\n")
    (out["zeroshot"] / "classnames.txt").write_text("\n".join(NAMES) + "\n")
    (out["zeroshot"] / "zeroshot_classification_templates.txt").write_text("\n".join(EVAL_TEMPLATES) + "\n")
    # the training captions' own class prompts ("a handwritten 7" needs the numeral, which {c} cannot give)
    (out["zeroshot"] / "prompts.json").write_text(json.dumps({NAMES[c]: specific_captions(c) for c in range(len(NAMES))}))
    (out["retrieval"] / "dataset_type.txt").write_text("retrieval\n")
    marker.write_text(source)
    return out


def write_digit_pairs(root: str | Path, split: str) -> Path:
    """{root}/pairs/{split}/0.tar: each digit image of `split` with the digits retrieval task's two captions
    (a class template and its instance caption). Redone only when the digit shards changed."""
    root = Path(root)
    folder = root / "pairs" / split
    marker, source = folder / "_SOURCE.json", digit_shards_marker(root).read_text()
    if marker.exists() and marker.read_text() == source:
        return folder
    samples = [{"__key__": s["__key__"], "jpg": s["jpg"],
                "txt": "\n".join(retrieval_captions(json.loads(s["json"]))).encode()}
               for s in iter_tar_samples(shard_paths(str(root), split))]
    write_tar(folder / "0.tar", samples)
    marker.write_text(source)
    return folder
