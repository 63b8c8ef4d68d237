"""The bundled digits dataset: real images, captions at three levels, deterministic split by image.

The shards are made the way a user's URL table is: served on 127.0.0.1 and downloaded by img2dataset.
"""
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
    indices = {}
    for split in SPLITS:
        samples = read_shards(tmp_path, split)
        assert len(samples) == counts[split]
        metas = [json.loads(s["json"]) for s in samples.values()]
        indices[split] = {m["digit_index"] for m in metas}
        assert len(indices[split]) == counts[split]  # no image twice
        first = next(iter(samples.values()))
        img = Image.open(io.BytesIO(first["jpg"]))
        assert img.size == (24, 24) and img.mode == "RGB"
        meta = json.loads(first["json"])
        assert meta["split"] == split and first["txt"].decode() in meta["captions"]["specific"]
        assert set(meta["captions"]) == {"specific", "mid", "general"} and meta["label"] in range(10)
        assert meta["url"].startswith("http://127.0.0.1:")  # fetched from the loopback server
        assert np.asarray(img).std() > 10  # a real drawing, not a blank image
        # img2dataset's per-shard stats sit next to every shard
        assert all((tmp_path / split / f"{t.stem}_stats.json").exists() for t in (tmp_path / split).glob("*.tar"))
    assert split_of(1797)[sorted(indices["test"])[0]] == "test"
    assert not (indices["train"] & indices["test"]) and not (indices["train"] & indices["val"])
    # Idempotent: a second call with the same parameters leaves the shards alone.
    stamp = (tmp_path / "train" / "00000.tar").stat().st_mtime_ns
    write_digit_shards(tmp_path, image_size=24, shard_size=400)
    assert (tmp_path / "train" / "00000.tar").stat().st_mtime_ns == stamp
