"""The bundled digits dataset: real images, captions at four levels, deterministic split by image.

The shards are made the way a user's URL table is: served on 127.0.0.1 and downloaded by img2dataset.
"""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines.digits.dataset import (NAMES, SPLITS, attribute_levels, attribute_values, captions_for, iter_digits,
                                      split_of)
from pipelines.digits.shards import prepare_digits, write_digit_shards


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
    assert "instance" not in caps
    assert captions_for(7, (2, 0, 2))["instance"][0] == "a bold narrow seven, slanted right"


def test_attributes_measure_the_strokes():
    blank = np.zeros((8, 8))
    thin_upright, bold_upright = blank.copy(), blank.copy()
    thin_upright[1:7, 4] = 8
    bold_upright[1:7, 3:5] = 16
    leaning_right = blank.copy()
    for y in range(1, 7):
        leaning_right[y, 7 - y] = 8  # row index grows downwards: the top of the stroke is on the right
    wide = blank.copy()
    wide[1:7, 1] = wide[1:7, 6] = 8
    ink, width, slant = attribute_values(np.stack([thin_upright, bold_upright, leaning_right, wide])).T
    assert ink[1] > ink[0] and width[3] > width[1] > width[0] == 0.0
    assert slant[2] > 0.5 and slant[0] == 0.0


def test_attribute_levels_are_tertiles_within_each_class():
    samples = list(iter_digits(8))
    levels = np.array([s.attributes for s in samples])
    labels = np.array([s.label for s in samples])
    for c in range(10):
        for j in range(3):
            counts = np.bincount(levels[labels == c, j], minlength=3)
            assert counts.max() - counts.min() <= 1  # equal thirds of the class
    # the levels follow the measured values: tertiles of a column are ordered
    values = np.array([[1.0], [5.0], [3.0], [2.0], [9.0], [4.0]])
    assert attribute_levels(values, np.zeros(6, int))[:, 0].tolist() == [0, 2, 1, 0, 2, 1]
    captions = {s.meta["captions"]["instance"][0] for s in samples}
    assert len(captions) > 200  # 27 kinds per class: a caption that picks out a few images of the set


def test_shards_hold_every_image_once(digits_root):
    """The session's digits (conftest: written once per pytest worker, image_size 32, shards of 500)."""
    tmp_path = Path(digits_root)
    counts = write_digit_shards(tmp_path, image_size=32, shard_size=500)  # the same parameters: read from its marker
    assert sum(counts.values()) == 1797
    assert len(list((tmp_path / "train").glob("*.tar"))) == -(-counts["train"] // 500)
    indices = {}
    for split in SPLITS:
        samples = read_shards(tmp_path, split)
        assert len(samples) == counts[split]
        metas = [json.loads(s["json"]) for s in samples.values()]
        indices[split] = {m["digit_index"] for m in metas}
        assert len(indices[split]) == counts[split]  # no image twice
        first = next(iter(samples.values()))
        img = Image.open(io.BytesIO(first["jpg"]))
        assert img.size == (32, 32) and img.mode == "RGB"
        meta = json.loads(first["json"])
        assert meta["split"] == split and first["txt"].decode() in meta["captions"]["specific"]
        assert set(meta["captions"]) == {"instance", "specific", "mid", "general"} and meta["label"] in range(10)
        assert meta["url"].startswith("http://127.0.0.1:")  # fetched from the loopback server
        assert np.asarray(img).std() > 10  # a real drawing, not a blank image
        # img2dataset's per-shard stats sit next to every shard
        assert all((tmp_path / split / f"{t.stem}_stats.json").exists() for t in (tmp_path / split).glob("*.tar"))
    assert split_of(1797)[sorted(indices["test"])[0]] == "test"
    assert not (indices["train"] & indices["test"]) and not (indices["train"] & indices["val"])
    # Idempotent: a second call with the same parameters leaves the shards alone.
    stamp = (tmp_path / "train" / "00000.tar").stat().st_mtime_ns
    write_digit_shards(tmp_path, image_size=32, shard_size=500)
    assert (tmp_path / "train" / "00000.tar").stat().st_mtime_ns == stamp


def test_run_seed_leaves_the_held_out_split_alone(digits_root):
    """A run, sweep trial or evaluation with another run.seed prepares the same digits: the shards written for
    data.split_seed 0 are kept, so no seed moves a model's training images into the split it is scored on."""
    from pipelines.pretrain.config import load_train_config
    from pipelines.inputs import prepare_data

    root = Path(digits_root)
    marker = json.loads((root / "_SUCCESS.json").read_text())
    stamp = (root / "test" / "00000.tar").stat().st_mtime_ns
    cfg = load_train_config(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml",
                      [f"data.root={digits_root}", "run.seed=1"])
    assert (cfg.run.seed, cfg.data.split_seed) == (1, 0)
    prepare_data(cfg)
    assert json.loads((root / "_SUCCESS.json").read_text()) == marker and marker["params"]["seed"] == 0
    assert (root / "test" / "00000.tar").stat().st_mtime_ns == stamp


def test_digits_written_before_are_kept_for_a_job_that_asks_so(digits_root):
    """prepare_digits, which every job on the digits calls: with keep_written (the adapter, whose source model trained
    on the digits already there) shards written with other parameters stay; the eval sets are there either way."""
    root = Path(digits_root)
    marker = (root / "_SUCCESS.json").read_text()
    stamp = (root / "test" / "00000.tar").stat().st_mtime_ns
    out = prepare_digits(root, image_size=64, shard_size=100, seed=3, keep_written=True)
    assert (root / "_SUCCESS.json").read_text() == marker and json.loads(marker)["params"]["image_size"] == 32
    assert (root / "test" / "00000.tar").stat().st_mtime_ns == stamp
    assert out == {"zeroshot": root / "eval" / "zeroshot", "retrieval": root / "eval" / "retrieval"}
    assert all((out[kind] / split / "0.tar").exists() for kind in out for split in ("val", "test"))
    assert (out["zeroshot"] / "classnames.txt").read_text().split() == NAMES
