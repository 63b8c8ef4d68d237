"""The bundled digits dataset: real images, captions at three levels, deterministic split by image."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines.digits import SPLITS, captions_for, split_of, write_digit_shards


def read_shards(root: Path, split: str) -> dict[str, dict]:
    samples: dict[str, dict] = {}
    for path in sorted((root / split).glob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def test_split_is_deterministic_and_disjoint():
    a, b = split_of(1797, seed=0), split_of(1797, seed=0)
    assert (a == b).all()
    counts = {s: int((a == s).sum()) for s in SPLITS}
    assert sum(counts.values()) == 1797 and counts["test"] > 300 and counts["val"] > 150
    assert not (split_of(1797, seed=1) == a).all()


def test_captions_have_three_levels():
    caps = captions_for(7)
    assert "the digit seven" in caps["specific"] and "a handwritten 7" in caps["specific"]
    assert "an odd digit" in caps["mid"]
    assert "a handwritten digit" in caps["general"]
    assert captions_for(4)["mid"][0] == "an even digit"


def test_shards_hold_every_image_once(tmp_path):
    counts = write_digit_shards(tmp_path, image_size=24, shard_size=400)
    assert sum(counts.values()) == 1797
    keys = {}
    for split in SPLITS:
        samples = read_shards(tmp_path, split)
        assert len(samples) == counts[split]
        keys[split] = set(samples)
        first = next(iter(samples.values()))
        img = Image.open(io.BytesIO(first["jpg"]))
        assert img.size == (24, 24) and img.mode == "RGB"
        meta = json.loads(first["json"])
        assert meta["split"] == split and first["txt"].decode() in meta["captions"]["specific"]
        assert np.asarray(img).std() > 10  # a real drawing, not a blank image
    assert not (keys["train"] & keys["test"]) and not (keys["train"] & keys["val"])
    # Idempotent: a second call with the same parameters leaves the shards alone.
    stamp = (tmp_path / "train" / "00000.tar").stat().st_mtime_ns
    write_digit_shards(tmp_path, image_size=24, shard_size=400)
    assert (tmp_path / "train" / "00000.tar").stat().st_mtime_ns == stamp
