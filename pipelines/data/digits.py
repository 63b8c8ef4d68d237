"""The bundled dataset: scikit-learn's 1,797 real handwritten digits as image-text pairs.

Each image carries captions at four levels of generality, which is what the probabilistic
models' uncertainty is asked to reflect (more general captions should be more uncertain):
"instance" (the class plus three attributes measured on that image: ink, width, slant, each as a
within-class tertile, e.g. "a bold wide seven, slanted right": 27 kinds per class, so ~1 match in a
batch of 128), "specific" (the class: the zero-shot templates), "mid" (parity / size) and "general"
(every image).

The digits take the same path as a user's URL table: the images are written to a folder, served by
`http.server` on 127.0.0.1 (ephemeral port, a thread), listed in one URL table per split (url,
caption, and label / split / captions / digit_index as extra columns that land in each sample's
json), and downloaded by `pipelines.download.run` (img2dataset on Ray tasks) into
{root}/{split}/NNNNN.tar webdataset shards.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIFIC_TEMPLATES = [
    "the digit {name}",
    "a handwritten {digit}",
    "a photo of the number {name}",
    "a drawing of the digit {digit}",
    "the number {name} written by hand",
]
GENERAL_CAPTIONS = ["a handwritten digit", "a number", "a scanned handwritten number"]
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.7, 0.1, 0.2)


def specific_captions(label: int) -> list[str]:
    return [t.format(name=NAMES[label], digit=label) for t in SPECIFIC_TEMPLATES]


ATTRIBUTE_WORDS = (("thin", "medium", "bold"), ("narrow", "medium-width", "wide"),
                   ("slanted left", "upright", "slanted right"))


def attribute_values(pixels: np.ndarray) -> np.ndarray:
    """(N, 8, 8) digit arrays -> (N, 3): ink (total intensity), width (ink-weighted horizontal spread),
    slant (ink-weighted regression of x on height; > 0 leans right)."""
    w = pixels.astype(np.float64)
    total = w.sum(axis=(1, 2))
    ys, xs = np.indices(pixels.shape[1:])
    mx = (w * xs).sum(axis=(1, 2)) / total
    my = (w * ys).sum(axis=(1, 2)) / total
    dx, dy = xs[None] - mx[:, None, None], my[:, None, None] - ys[None]  # dy > 0 upwards
    width = np.sqrt((w * dx**2).sum(axis=(1, 2)) / total)
    slant = (w * dx * dy).sum(axis=(1, 2)) / (w * dy**2).sum(axis=(1, 2))
    return np.stack([total, width, slant], axis=1)


def attribute_levels(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N, 3) values -> (N, 3) levels 0..2: the tertile of each value among the images of the same class."""
    levels = np.zeros(values.shape, dtype=np.int64)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        for j in range(values.shape[1]):
            rank = np.argsort(np.argsort(values[idx, j], kind="stable"), kind="stable")
            levels[idx, j] = rank * 3 // len(idx)
    return levels


def instance_captions(label: int, levels) -> list[str]:
    ink, width, slant = (words[int(i)] for words, i in zip(ATTRIBUTE_WORDS, levels))
    return [f"a {ink} {width} {NAMES[label]}, {slant}", f"a {ink}, {width} handwritten {label}, {slant}"]


def mid_captions(label: int) -> list[str]:
    parity = "an odd digit" if label % 2 else "an even digit"
    size = "a digit greater than four" if label > 4 else "a digit less than five"
    return [parity, size]


def captions_for(label: int, levels=None) -> dict[str, list[str]]:
    """Captions by level; "instance" only with the image's attribute levels."""
    caps = {"specific": specific_captions(label), "mid": mid_captions(label), "general": list(GENERAL_CAPTIONS)}
    if levels is not None:
        caps["instance"] = instance_captions(label, levels)
    return caps


def split_of(n: int, seed: int = 0) -> np.ndarray:
    """Deterministic split by image: array of split names, one per image index."""
    order = np.random.default_rng(seed).permutation(n)
    bounds = np.cumsum([int(round(f * n)) for f in SPLIT_FRACTIONS[:-1]])
    names = np.empty(n, dtype=object)
    for name, idx in zip(SPLITS, np.split(order, bounds)):
        names[idx] = name
    return names


def digit_image(pixels: np.ndarray, size: int) -> Image.Image:
    """8x8 array in 0..16 -> size x size RGB image (white ink on black)."""
    gray = Image.fromarray(np.clip(pixels * 16, 0, 255).astype(np.uint8), mode="L")
    return gray.resize((size, size), Image.BILINEAR).convert("RGB")


@dataclass
class DigitSample:
    key: str
    label: int
    split: str
    image: Image.Image
    attributes: tuple[int, int, int]  # ink, width, slant levels (0..2) within the class

    @property
    def meta(self) -> dict:
        return {"label": self.label, "split": self.split, "captions": captions_for(self.label, self.attributes)}


def iter_digits(image_size: int, seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    splits = split_of(len(digits.target), seed)
    levels = attribute_levels(attribute_values(digits.images), digits.target)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        yield DigitSample(f"{i:06d}", int(label), str(splits[i]), digit_image(pixels, image_size),
                          tuple(int(v) for v in levels[i]))


def write_url_tables(root: str | Path, image_size: int, seed: int, base_url: str) -> dict[str, Path]:
    """Images under {root}/_source/images (served as {base_url}/images/...) and one parquet URL table per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    import shutil

    import ray

    from pipelines.config import DownloadConfig
    from pipelines.download.run import run_download
    from pipelines.download.summary import format_summary
    from pipelines.cluster.file_server import LoopbackServer
    from pipelines.cluster.runtime import init_ray

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
                summary = run_download(cfg, local_only=True, log=lambda *_: None)
                if summary["written"] != summary["input_rows"]:
                    raise RuntimeError(f"digits {split}: not every image was written\n{format_summary(summary)}")
                counts[split] = summary["written"]
    finally:
        if own_ray:
            ray.shutdown()
    marker.write_text(json.dumps({"params": wanted, "counts": counts}))
    return counts


# Evaluation sets: the zero-shot set in CLIP_benchmark's webdataset layout, and image-caption pairs for
# retrieval, both from the downloaded val/test shards (the same image bytes as the held-out splits).
EVAL_TEMPLATES = ["the digit {c}", "a photo of the number {c}", "the number {c} written by hand"]


def write_tar(path: Path, samples: list[dict[str, bytes]]) -> None:
    """Samples {"__key__": key, ext: bytes} -> a webdataset tar (members key.ext, fixed mtime)."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)


def retrieval_captions(meta: dict) -> list[str]:
    """Two captions per image: one of the class templates (shared by ~a fifth of the class) and its
    instance caption (class + ink, width, slant: shared by a few images)."""
    caps = meta["captions"]
    return [caps["specific"][int(meta["digit_index"]) % len(caps["specific"])], caps["instance"][0]]


def write_digit_eval_sets(root: str | Path, splits=("val", "test")) -> dict[str, Path]:
    """{root}/eval/zeroshot (classnames.txt, zeroshot_classification_templates.txt, prompts.json with the
    exact class prompts of training, {split}/0.tar with jpg + cls) and {root}/eval/retrieval ({split}/0.tar
    with jpg + txt, two captions a line each). Idempotent: redone only when the shards changed."""
    from pipelines.evaluate.data import iter_tar_samples
    from pipelines.data.reader import shard_paths

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
