"""Ray Data over webdataset shards: decode, pick a caption, tokenize, hand batches to Ray Train."""
from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image

from models.tokenizer import tokenize

MEAN, STD = 0.5, 0.5


def shard_paths(root: str, split: str) -> list[str]:
    import fsspec

    fs, _, [base] = fsspec.get_fs_token_paths(root)
    pattern = f"{base.rstrip('/')}/{split}/*.tar"
    paths = sorted(fs.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no shards match {pattern}")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return paths if protocol in ("file", "local") else [f"{protocol}://{p}" for p in paths]


class Preprocess:
    """Row batch of raw webdataset bytes -> image (B,3,H,W) float32, text (B,L) int64, label (B,)."""

    def __init__(self, image_size: int, context_length: int, mid_prob: float = 0.0, general_prob: float = 0.0,
                 seed: int | None = None):
        self.image_size, self.context_length = image_size, context_length
        self.mid_prob, self.general_prob = mid_prob, general_prob
        self.rng = np.random.default_rng(seed)

    def caption(self, meta: dict, fallback: str) -> str:
        caps = meta.get("captions")
        if not caps:
            return fallback
        u = self.rng.random()
        level = "general" if u < self.general_prob else "mid" if u < self.general_prob + self.mid_prob else "specific"
        options = caps.get(level) or caps["specific"]
        return options[self.rng.integers(len(options))]

    def image(self, data: bytes) -> np.ndarray:
        img = Image.open(io.BytesIO(data)).convert("RGB")
        if img.size != (self.image_size, self.image_size):
            img = img.resize((self.image_size, self.image_size), Image.BICUBIC)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        return ((arr - MEAN) / STD).transpose(2, 0, 1)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, texts, labels = [], [], []
        for jpg, txt, meta_raw in zip(batch["jpg"], batch["txt"], batch["json"]):
            meta = json.loads(meta_raw) if meta_raw is not None else {}
            txt = txt.decode("utf-8", errors="replace") if isinstance(txt, bytes) else str(txt)
            images.append(self.image(jpg))
            texts.append(self.caption(meta, txt))
            labels.append(int(meta.get("label", -1)))
        return {
            "image": np.stack(images),
            "text": tokenize(texts, self.context_length).numpy(),
            "label": np.asarray(labels, dtype=np.int64),
        }


def read_split(root: str, split: str, image_size: int, context_length: int, mid_prob: float = 0.0,
               general_prob: float = 0.0, seed: int | None = None):
    import ray.data

    ds = ray.data.read_webdataset(shard_paths(root, split), decoder=None)
    # Tasks rather than an actor pool: each epoch re-executes the pipeline, and tasks start cheaply.
    return ds.map_batches(
        _preprocess, fn_kwargs=dict(image_size=image_size, context_length=context_length,
                                    mid_prob=mid_prob, general_prob=general_prob, seed=seed),
        batch_size=256, batch_format="numpy",
    )


def _preprocess(batch: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return Preprocess(**kwargs)(batch)
