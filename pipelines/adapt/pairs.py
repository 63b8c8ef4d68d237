"""Training pairs of the adapter: the frozen model's embeddings of image-caption pairs.

Embeddings live in `jobs.embed`'s layout ({folder}/images/*.parquet: key, captions, mu; {folder}/texts:
index, text, mu), written by Ray Data batch inference of the source model when the folder has none yet.
Every caption line of an image makes one (image embedding, caption embedding) pair. Embeddings are
checked before training: the source model's width, finite values, no sigma^2 (a probabilistic model's).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.adapt.source import AdaptError
from pipelines.storage import fs_path
from pipelines.evaluate.in_process import distinct_captions, split_captions
from pipelines.evaluate.inference import read_embeddings, write_image_embeddings, write_text_embeddings


def has_embeddings(folder: str | Path) -> bool:
    """Whether the folder (local, or a URI on object storage) holds image and text embeddings."""
    fs, path = fs_path(str(folder))
    return all(fs.glob(f"{path}/{part}/*.parquet") for part in ("images", "texts"))


def compute_embeddings(model_file: Path, paths: list[str], image_size: int, folder: str | Path, opts) -> None:
    """The source model's image and caption embeddings of the pair shards (Ray Data actor pools)."""
    images = write_image_embeddings(str(model_file), paths, image_size, folder, opts, stats_name="adapt_embed")
    cols, _ = read_embeddings(images, "key")
    texts = distinct_captions(split_captions(cols["captions"]))
    if not texts:
        raise AdaptError(f"data: no image of {paths[0]} ... has a caption; the adapter trains on image-caption pairs")
    write_text_embeddings(str(model_file), texts, folder, opts)


@dataclass
class Pairs:
    image: np.ndarray  # (P, D) float32, the frozen image embedding of each pair
    text: np.ndarray  # (P, D) float32, its caption's
    n_images: int
    n_texts: int


def _check(what: str, folder: str | Path, out: dict, width: int, names: list) -> np.ndarray:
    if "logvar" in out:
        raise AdaptError(f"data.embeddings: {folder}/{what} carries logvar (sigma^2): embeddings of a probabilistic "
                         "model; the adapter learns uncertainty for a deterministic model's embeddings")
    mu = out["mu"].numpy().astype(np.float32, copy=False)
    if mu.shape[1] != width:
        raise AdaptError(f"data.embeddings: {what} embeddings in {folder} are {mu.shape[1]}-d but the source model's "
                         f"(and so the adapter's) are {width}-d: embeddings of another model?")
    bad = ~np.isfinite(mu).all(axis=1)
    if bad.any():
        first = names[int(np.flatnonzero(bad)[0])]
        raise AdaptError(f"data.embeddings: {int(bad.sum())} of {len(mu)} {what} embeddings in {folder} are not finite "
                         f"(NaN/inf), e.g. {first!r}")
    return mu


def load_pairs(folder: str | Path, width: int) -> Pairs:
    """Pairs from an embeddings folder (local, or a URI on object storage), or AdaptError naming what is wrong with
    it."""
    try:
        image_cols, image = read_embeddings(f"{folder}/images", "key")
        text_cols, text = read_embeddings(f"{folder}/texts", "index")
    except (ValueError, OSError, KeyError) as err:
        raise AdaptError(f"data.embeddings: cannot read {folder} as jobs.embed output ({err})") from None
    image_mu = _check("image", folder, image, width, image_cols["key"])
    text_mu = _check("text", folder, text, width, text_cols["text"])
    index = {t: i for i, t in enumerate(text_cols["text"])}
    rows, cols = [], []
    for i, (key, caps) in enumerate(zip(image_cols["key"], split_captions(image_cols["captions"]))):
        for c in caps:
            if c not in index:
                raise AdaptError(f"data.embeddings: caption {c!r} of image {key!r} has no embedding in {folder}/texts")
            rows.append(i)
            cols.append(index[c])
    if not rows:
        raise AdaptError(f"data.embeddings: no image in {folder} has a caption; the adapter trains on pairs")
    return Pairs(image_mu[rows], text_mu[cols], len(image_mu), len(text_mu))
