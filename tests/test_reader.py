"""Reader: decode (corrupt samples skipped and counted), augmentation for train only, seeded,
and every sample reaching exactly one of 2 Ray Train workers per epoch."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import webdataset as wds
from PIL import Image

from models.preprocess import decode_image, resize
from pipelines.data.augmentation import augment_batch, color_maps, random_crop_boxes
from pipelines.data.captions import CaptionSampler
from pipelines.data.device_augment import model_images
from pipelines.data.reader import read_shards, read_split
from pipelines.data.stats import reader_stats
from tests.helpers import BUCKET
from tests.pace import scaled
from tests.small_runs import ROOT

SIZE, CONTEXT = 16, 12


def image_bytes(seed: int, size=(20, 24)) -> bytes:
    rng = np.random.default_rng(seed)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_shards(folder: Path, n_good: int, per_shard: int, corrupt: bool = True) -> tuple[list[str], set[int], int]:
    """Numbered samples in several .tar shards, plus (optionally) four corrupt ones spread over them."""
    folder.mkdir(parents=True, exist_ok=True)
    samples = [{"__key__": f"{i:06d}", "jpg": image_bytes(i), "txt": f"caption {i}".encode(),
                "json": json.dumps({"label": i % 10}).encode()} for i in range(n_good)]
    bad = []
    if corrupt:
        bad = [
            {"__key__": "900000", "jpg": b"<html>not an image</html>", "txt": b"x", "json": b"{}"},
            {"__key__": "900001", "jpg": image_bytes(5, (64, 64))[:200], "txt": b"truncated", "json": b"{}"},
            {"__key__": "900002", "txt": b"no image at all", "json": b"{}"},
            {"__key__": "900003", "jpg": image_bytes(6), "txt": b"bad json", "json": b"{not json"},
        ]
    everything = samples[: n_good // 2] + bad + samples[n_good // 2:]
    paths = []
    for shard, start in enumerate(range(0, len(everything), per_shard)):
        path = folder / f"{shard:05d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for s in everything[start : start + per_shard]:
                sink.write(s)
        paths.append(str(path))
    return paths, set(range(n_good)), len(bad)


def settled_stats(name: str, decoded: int) -> dict:
    """Reader tasks send their counts without waiting for them: the last may arrive just after the data."""
    for _ in range(200):
        stats = reader_stats(name)
        if stats["decoded"] >= decoded:
            break
        time.sleep(0.05)
    return stats


def test_corrupt_samples_are_counted_not_fatal(ray_local, tmp_path):
    paths, good, n_bad = write_shards(tmp_path / "shards", n_good=30, per_shard=7)
    ds = read_shards(paths, SIZE, CONTEXT, stats_name="corrupt-test", batch_size=8)
    rows = ds.take_all()
    assert sorted(r["sample_id"] for r in rows) == sorted(good)
    assert all(r["image"].shape == (3, SIZE, SIZE) and r["text"].shape == (CONTEXT,) for r in rows)
    assert {r["label"] for r in rows} == set(range(10))
    stats = settled_stats("corrupt-test", len(good))
    assert stats["decoded"] == len(good) and sum(stats["skipped"].values()) == n_bad == 4
    assert stats["skipped_unique"] == {"undecodable image": 2, "no image": 1, "unreadable json": 1}
    assert {k for refs in stats["examples"].values() for _, k in refs} == {"900000", "900001", "900002", "900003"}


def test_broken_files_are_named_and_counted_and_keep_what_precedes_the_break(ray_local, tmp_path):
    """A truncated tar keeps the samples before its break; a file that is not a tar, an empty one and one the
    store cannot open (gone between listing and reading: what an object store's failed read looks like) give none;
    each is counted with its name and reason, and the read goes on."""
    from tests.faults import truncated_tar

    paths, good, _ = write_shards(tmp_path / "shards", n_good=20, per_shard=10, corrupt=False)
    samples = [{"__key__": f"{800000 + i}", "jpg": image_bytes(i), "txt": b"c", "json": b"{}"} for i in range(12)]
    truncated_tar(tmp_path / "shards" / "cut.tar", samples, keep=7)
    (tmp_path / "shards" / "html.tar").write_bytes(b"<html>" * 200)
    (tmp_path / "shards" / "empty.tar").write_bytes(b"")
    write_shards(tmp_path / "gone", n_good=3, per_shard=3, corrupt=False)
    gone = str(tmp_path / "gone" / "00000.tar")
    names = [str(tmp_path / "shards" / n) for n in ("cut.tar", "html.tar", "empty.tar")]
    ds = read_shards(paths + names + [gone], SIZE, CONTEXT, stats_name="files-test", batch_size=8, cache=False)
    Path(gone).unlink()
    ids = sorted(r["sample_id"] for r in ds.take_all())
    assert ids == sorted(good | {800000 + i for i in range(7)})
    files = settled_stats("files-test", len(ids))["files"]
    assert {Path(p).name: (f["reason"], f["kept"]) for p, f in files.items()} == {
        "cut.tar": ("truncated tar", 7), "html.tar": ("not a tar file", 0), "empty.tar": ("empty file", 0),
        "00000.tar": ("unreadable file", 0)}
    assert "FileNotFoundError" in files[gone]["detail"] and all(f["reads"] == 1 for f in files.values())


def test_broken_objects_on_s3_are_named_and_counted_and_keep_what_precedes_the_break(s3, ray_local, tmp_path):
    """The same on an S3-protocol store (moto): a good shard read whole, a truncated one up to its break, and an
    object deleted after the paths were listed (the store answers 404) named by its s3:// path, none fatal."""
    from tests.faults import truncated_tar

    paths, good, _ = write_shards(tmp_path / "good", n_good=6, per_shard=6, corrupt=False)
    samples = [{"__key__": f"{700000 + i}", "jpg": image_bytes(i), "txt": b"c", "json": b"{}"} for i in range(5)]
    truncated_tar(tmp_path / "cut.tar", samples, keep=3)
    prefix = f"{BUCKET}/reader-broken"
    s3.put(paths[0], f"{prefix}/good.tar")
    s3.put(str(tmp_path / "cut.tar"), f"{prefix}/cut.tar")
    s3.put(paths[0], f"{prefix}/gone.tar")
    uris = [f"s3://{prefix}/{n}.tar" for n in ("good", "cut", "gone")]
    ds = read_shards(uris, SIZE, CONTEXT, stats_name="s3-files-test", batch_size=8, cache=False)
    s3.rm(f"{prefix}/gone.tar")
    ids = sorted(r["sample_id"] for r in ds.take_all())
    assert ids == sorted(good | {700000 + i for i in range(3)})
    files = settled_stats("s3-files-test", len(ids))["files"]
    # named as Ray's file listing gives them: bucket/key (the scheme dropped)
    assert {p: (f["reason"], f["kept"]) for p, f in files.items()} == {
        f"{prefix}/cut.tar": ("truncated tar", 3), f"{prefix}/gone.tar": ("unreadable file", 0)}
    assert "FileNotFoundError" in files[f"{prefix}/gone.tar"]["detail"]


def same_batches_read(files: list[str]) -> list:
    """A seeded, shuffled, augmented read of small shards: each batch's sample ids, tokens and image digest."""
    ds = read_shards(files, SIZE, CONTEXT, seed=3, augment=True, shuffle=True, stats_name=None, batch_size=8)
    ds.context.execution_options.preserve_order = True
    return [[b["sample_id"].tolist(), b["text"].tolist(), hashlib.sha256(b["image"].tobytes()).hexdigest()]
            for b in ds.iter_batches(batch_size=None, batch_format="numpy")]


# The read again in a process of its own, on a local Ray of one CPU: a cluster of another size than the tests' Ray.
OTHER_SIZE = """
import json, sys
import ray
from pipelines.cluster.runtime import init_ray
from tests.test_reader import same_batches_read
init_ray(num_cpus=1)
files = json.loads(sys.argv[1])
print(json.dumps({"cpus": ray.cluster_resources()["CPU"], "batches": [same_batches_read(f) for f in files]}))
"""


def test_small_shards_give_the_same_batches_from_the_disk_and_from_object_storage_at_any_cluster_size(
        s3, ray_local, tmp_path):
    """Small shards (kept in Ray's object store after one read) are read on the driver, a block per file, wherever
    they are and whatever the cluster's size: a seeded, shuffled, augmented read of the same files from the local
    disk and from S3, on the tests' Ray and on a Ray of one CPU, gives the same batches, row for row (a resumed or
    elastic run on a cluster reading object storage then matches a local one bit for bit; a Ray Data read would split
    its blocks by the cluster's size, and the batches with them)."""
    paths, good, _ = write_shards(tmp_path / "local", n_good=40, per_shard=15, corrupt=False)
    prefix = f"{BUCKET}/reader-same-batches"
    for path in paths:
        s3.put(path, f"{prefix}/{Path(path).name}")
    uris = [f"s3://{prefix}/{Path(p).name}" for p in paths]

    here = same_batches_read(paths)
    assert sorted(i for b in here for i in b[0]) == sorted(good)
    assert same_batches_read(uris) == here
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own, not the tests'
    run = subprocess.run([sys.executable, "-c", OTHER_SIZE, json.dumps([paths, uris])], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=scaled(180))
    assert run.returncode == 0, run.stderr[-3000:]
    other = json.loads(run.stdout.strip().splitlines()[-1])
    assert other["cpus"] == 1 and ray.cluster_resources()["CPU"] > 1  # two sizes
    assert other["batches"] == [here, here]  # from the disk and from S3


def test_augmentation_on_for_train_off_for_eval_and_seeded(ray_local, tmp_path):
    write_shards(tmp_path / "train", n_good=12, per_shard=12, corrupt=False)
    write_shards(tmp_path / "test", n_good=12, per_shard=12, corrupt=False)

    def images(split, seed, **kw):
        rows = read_split(str(tmp_path), split, SIZE, CONTEXT, seed=seed, stats_name=f"aug-{split}", **kw).take_all()
        return {r["sample_id"]: r["image"] for r in rows}

    evaluation = images("test", seed=None)
    plain = {}
    for i in range(12):  # eval = decode + plain resize, every time
        arr = resize(decode_image(image_bytes(i)), SIZE)
        plain[i] = ((arr.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)
        pil = np.asarray(Image.open(io.BytesIO(image_bytes(i))).convert("RGB"), float)
        assert np.abs(decode_image(image_bytes(i)) - pil).mean() < 2  # RGB order, the same picture as PIL's
    assert all(np.allclose(evaluation[i], plain[i], atol=1e-6) for i in range(12))
    a, b, c = images("train", seed=3), images("train", seed=3), images("train", seed=4)
    assert set(a) == set(range(12)) and all(np.array_equal(a[i], b[i]) for i in a)  # seeded: reproducible
    assert sum(not np.allclose(a[i], plain[i]) for i in a) >= 10  # augmented
    assert sum(not np.array_equal(a[i], c[i]) for i in a) >= 10  # another seed, other augmentations
    noaug = images("train", seed=3, augment=False)
    assert all(np.allclose(noaug[i], plain[i]) for i in noaug)


def test_augment_crop_jitter_grayscale_rates():
    img = decode_image(image_bytes(1, (40, 40)))
    rng = np.random.default_rng(0)
    outs = [np.rint(augment_batch([img], SIZE, rng)[0] * 255).astype(np.int16) for _ in range(300)]
    assert all(o.shape == (SIZE, SIZE, 3) for o in outs)
    gray = np.mean([np.abs(o[..., 0] - o[..., 1]).max() <= 1 and np.abs(o[..., 1] - o[..., 2]).max() <= 1
                    for o in outs])
    assert 0.12 < gray < 0.28  # p = 0.2
    # RandomResizedCrop keeps 80-100% of the area: a marked corner pixel survives a crop often, not always
    marked = np.zeros((100, 100, 3), np.uint8)
    marked[:4, :4] = 255
    one = np.array([100])
    kept = [resize(marked, 100, random_crop_boxes(one, one, rng)[0])[:2, :2].mean() > 100 for _ in range(300)]
    assert 0.05 < np.mean(kept) < 0.6


def luma(x):
    return x @ np.array([0.299, 0.587, 0.114])


def apply(maps, x):
    a, b = maps
    return np.einsum("bij,bpj->bpi", a.astype(np.float64), x) + b[:, None, :]


def test_color_maps_against_their_definitions():
    """Each jitter operation alone, on random pixels (no clipping), against what it is defined to do."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.2, 0.8, (64, 50, 3))  # 64 images of 50 pixels
    means = x.mean(axis=1)
    only = dict(brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0, jitter_p=1.0, gray_p=0.0)

    y = apply(color_maps(means, rng, **{**only, "brightness": 0.4}), x)
    f = y / x
    assert np.allclose(f, f[:, :1, :1]) and 0.6 <= f.min() and f.max() <= 1.4 and f.std() > 0.05

    y = apply(color_maps(means, rng, **{**only, "contrast": 0.4}), x)
    assert np.allclose(luma(y).mean(1), luma(x).mean(1))  # blends towards the mean luma: mean kept
    dev_x, dev_y = x - luma(x).mean(1)[:, None, None], y - luma(y).mean(1)[:, None, None]
    c = dev_y / dev_x
    assert np.allclose(c, c[:, :1, :1]) and 0.6 <= c.min() and c.max() <= 1.4

    for key in ("saturation", "hue"):  # both leave each pixel's luma alone and change its colour
        y = apply(color_maps(means, rng, **{**only, key: 0.4 if key == "saturation" else 0.1}), x)
        assert np.allclose(luma(y), luma(x)) and np.abs(y - x).max() > 0.01

    y = apply(color_maps(means, rng, **{**only, "jitter_p": 0.0, "gray_p": 1.0}), x)
    assert np.allclose(y, luma(x)[..., None].repeat(3, -1))

    y = apply(color_maps(means, rng, **{**only, "jitter_p": 0.0}), x)  # nothing drawn: identity
    assert np.allclose(y, x)


STREAMS = {"split": False, "ordered_a": True, "ordered_b": True}  # dataset -> data.deterministic


@pytest.fixture(scope="module")
def streams(ray_local, tmp_path_factory) -> dict:
    """{(dataset, epoch, rank): [(sample_id, caption tokens, image checksum), ...]} as 2 Ray Train workers see
    them, for STREAMS read in one Train run: "split" from shards with corrupt samples, "ordered_a" and
    "ordered_b" built alike from clean shards with ordered reads (two executions of the same pipeline)."""
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    tmp = tmp_path_factory.mktemp("streams")
    paths = {"split": write_shards(tmp / "corrupt", n_good=90, per_shard=10),
             "ordered": write_shards(tmp / "clean", n_good=90, per_shard=10, corrupt=False)}
    out = tmp / "out"
    out.mkdir()

    def loop(config):
        ctx = ray.train.get_context()
        for name in config["datasets"]:
            shard = ray.train.get_dataset_shard(name)
            for epoch in range(config["epochs"]):
                rows = []
                for batch in shard.iter_torch_batches(batch_size=8, local_shuffle_buffer_size=16,
                                                      local_shuffle_seed=epoch):
                    images = model_images(batch, SIZE)  # the training path: augmented on the worker's device
                    assert images.shape[1:] == (3, SIZE, SIZE)
                    rows += [[int(i), t.tolist(), round(float(im.double().sum()), 6)]
                             for i, t, im in zip(batch["sample_id"], batch["text"], images)]
                Path(config["out"], f"{name}-{epoch}-{ctx.get_world_rank()}.json").write_text(json.dumps(rows))
        ray.train.report({"done": 1})

    datasets = {name: read_shards(paths["ordered" if ordered else "split"][0], SIZE, CONTEXT, seed=0, augment=True,
                                  shuffle=True, stats_name=f"streams-{name}", batch_size=16,
                                  uint8=True, augment_on="device")
                for name, ordered in STREAMS.items()}
    trainer = TorchTrainer(
        loop, train_loop_config={"epochs": 2, "out": str(out), "datasets": list(STREAMS)},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(name="reader-streams", storage_path=str(tmp / "ray")),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(execution_options={
            name: ExecutionOptions(preserve_order=ordered) for name, ordered in STREAMS.items()}),
    )
    trainer.fit()
    seen = {(n, e, r): json.loads((out / f"{n}-{e}-{r}.json").read_text())
            for n in STREAMS for e in range(2) for r in range(2)}
    return seen, paths["split"][1]


def test_every_sample_reaches_exactly_one_worker_per_epoch(streams):
    seen, good = streams
    for epoch in range(2):
        ids = [[row[0] for row in seen["split", epoch, rank]] for rank in range(2)]
        assert all(ids), "both workers got data"
        assert len(ids[0]) + len(ids[1]) == len(good)  # nothing twice
        assert set(ids[0]) | set(ids[1]) == good  # nothing missing, corrupt samples skipped
        assert not set(ids[0]) & set(ids[1])
    assert sum(settled_stats("streams-split", 2 * len(good))["skipped_unique"].values()) == 4


def test_ordered_reads_repeat_exactly(streams):
    """data.deterministic: two executions give each worker the same samples, captions and augmentations, in order."""
    seen, _ = streams
    for epoch in range(2):
        for rank in range(2):
            assert seen["ordered_a", epoch, rank] == seen["ordered_b", epoch, rank]
    first = seen["ordered_a", 0, 0]
    assert first and [r[0] for r in first] != [r[0] for r in seen["ordered_a", 1, 0]]  # yet reshuffled between epochs


def test_caption_levels_are_drawn_at_their_shares():
    caps = {"general": ["g"], "mid": ["m"], "instance": ["i"], "specific": ["s1", "s2"]}
    sampler, rng = CaptionSampler(mid=0.1, general=0.2, instance=0.4), np.random.default_rng(0)
    drawn = [sampler.draw({"captions": caps}, "fallback", rng) for _ in range(4000)]
    share = {c: drawn.count(c) / len(drawn) for c in ("g", "m", "i")}
    assert abs(share["g"] - 0.2) < 0.03 and abs(share["m"] - 0.1) < 0.03 and abs(share["i"] - 0.4) < 0.03
    assert abs((drawn.count("s1") + drawn.count("s2")) / len(drawn) - 0.3) < 0.03
    # a level the sample lacks falls back to the specific captions; no captions at all: the txt
    no_instance = {k: v for k, v in caps.items() if k != "instance"}
    assert {sampler.draw({"captions": no_instance}, "fallback", rng) for _ in range(200)} <= {"g", "m", "s1", "s2"}
    assert sampler.draw({}, "fallback", rng) == "fallback"
    for odd in (["a list"], {"general": []}, {"specific": "not a list"}):
        assert sampler.draw({"captions": odd}, "fallback", rng) == "fallback"


def test_jpeg_decoding_matches_opencv_and_shrinks_in_the_dct_when_asked():
    """JPEGs decode with simplejpeg (a dependency: it must be there, not silently replaced by OpenCV), to exactly
    OpenCV's pixels: simplejpeg's own decode is compared with OpenCV's, and decode_image returns it."""
    import cv2
    import simplejpeg

    from models import preprocess

    assert preprocess.simplejpeg is simplejpeg  # models.preprocess found it (its fallback is OpenCV)
    rng = np.random.default_rng(0)
    arr = (rng.random((97, 131, 3)) * 255).astype(np.uint8)
    for mode, options in (("RGB", {}), ("RGB", {"subsampling": 0, "progressive": True}), ("L", {})):
        buf = io.BytesIO()
        Image.fromarray(arr).convert(mode).save(buf, format="JPEG", **options)
        data = buf.getvalue()
        opencv = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        turbo = simplejpeg.decode_jpeg(data, colorspace="RGB")
        # evaluation and serving see the same pixels whichever decoder a machine has
        assert np.array_equal(turbo, opencv), mode
        assert np.array_equal(decode_image(data), turbo), mode
    big = image_bytes(0, (512, 384))
    assert decode_image(big).shape == (384, 512, 3)
    small = decode_image(big, min_size=150)
    assert small.shape == (192, 256, 3)  # DCT scaling by 1/2: both sides still >= 150
    assert np.abs(small.astype(float).mean() - decode_image(big).astype(float).mean()) < 2


def test_images_as_users_have_them_decode_to_the_rgb_the_model_expects():
    """Every stored form of a picture decodes to its RGB, against PIL (and OpenCV for 16 bits): grayscale, palette,
    transparency on white (as jobs.download's resizer writes it), 16-bit, CMYK, EXIF orientation applied, WebP;
    a large JPEG shrunk in the DCT as PIL's draft does."""
    import cv2
    from PIL import ImageOps

    from tests.faults import encode, exif_rotated_jpeg, png16, rgba_png

    rng = np.random.default_rng(0)
    rgb = Image.fromarray((rng.random((37, 53, 3)) * 255).astype(np.uint8))

    def pil(data: bytes) -> np.ndarray:
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
            im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im.convert("RGBA"))
        return np.asarray(im.convert("RGB"), np.int16)

    forms = {
        "gray png": encode(rgb.convert("L"), "PNG"), "palette png": encode(rgb.convert("P"), "PNG"),
        "rgba png": rgba_png(rgb), "la png": encode(rgb.convert("LA"), "PNG"),
        "lossless webp": encode(rgb, "WEBP", lossless=True),
        "rgba webp": encode(rgb.convert("RGBA"), "WEBP", lossless=True),
        "gray jpeg": encode(rgb.convert("L"), "JPEG"), "exif jpeg": exif_rotated_jpeg(rgb),
    }
    for name, data in forms.items():
        assert np.array_equal(decode_image(data), pil(data)), name
    y, x = np.mgrid[0:37, 0:53]
    smooth = Image.fromarray(np.stack([x * 4, y * 6, x + y], -1).astype(np.uint8))
    exif = decode_image(exif_rotated_jpeg(smooth))
    assert exif.shape == (37, 53, 3) and np.abs(exif - np.asarray(smooth, np.int16)).max() < 8  # upright again
    rgba = decode_image(forms["rgba png"])
    assert (rgba[:, : 53 // 4] == 255).all()  # the transparent band is white
    # lossy forms: the same picture as PIL's decoder within rounding
    cmyk = encode(rgb.convert("CMYK"), "JPEG", quality=95)
    assert np.abs(decode_image(cmyk).astype(np.int16) - pil(cmyk)).max() <= 1
    webp = encode(rgb, "WEBP", quality=90)
    assert np.abs(decode_image(webp).astype(np.int16) - pil(webp)).mean() < 1
    # 16 bits: the high byte of each sample, as OpenCV's own 8-bit conversion
    wide = (rng.random((20, 30, 3)) * 65535).astype(np.uint16)
    data16 = cv2.imencode(".png", wide)[1].tobytes()
    assert np.array_equal(decode_image(data16), (wide >> 8).astype(np.uint8)[..., ::-1])
    assert np.array_equal(decode_image(png16(rgb)), np.asarray(rgb))
    # a large JPEG shrunk in the DCT (min_size) is PIL's draft of it
    big = Image.fromarray((rng.random((600, 800, 3)) * 255).astype(np.uint8))
    data = encode(big, "JPEG", quality=90)
    drafted = Image.open(io.BytesIO(data))
    drafted.draft("RGB", (200, 150))
    small = decode_image(data, min_size=150)
    assert small.shape == (150, 200, 3) and np.abs(small.astype(np.int16) - np.asarray(drafted, np.int16)).max() <= 2


def test_a_decompression_bomb_is_refused_by_its_header():
    """A 12000x12000 PNG (140 KB of zeros, 432 MB decoded) and a WebP / JPEG over the limit are refused before any
    pixel is decoded; the limit is models.preprocess.MAX_IMAGE_PIXELS."""
    import tracemalloc

    from models import preprocess
    from models.preprocess import ImageTooLarge, image_dimensions
    from tests.faults import encode

    bomb = encode(Image.new("L", (12000, 12000)), "PNG")
    assert len(bomb) < 1_000_000 and image_dimensions(bomb) == (12000, 12000)
    tracemalloc.start()
    with pytest.raises(ImageTooLarge, match=r"12000x12000 pixels, over models\.preprocess\.MAX_IMAGE_PIXELS"):
        decode_image(bomb)
    assert tracemalloc.get_traced_memory()[1] < 10_000_000  # nothing the size of the image was allocated
    tracemalloc.stop()
    small = Image.new("RGB", (300, 200))
    for fmt, options in (("WEBP", {}), ("WEBP", {"lossless": True}), ("JPEG", {}), ("PNG", {})):
        data = encode(small, fmt, **options)
        assert image_dimensions(data) == (300, 200), fmt
        limit, preprocess.MAX_IMAGE_PIXELS = preprocess.MAX_IMAGE_PIXELS, 300 * 200 - 1
        try:
            with pytest.raises(ImageTooLarge):
                decode_image(data)
        finally:
            preprocess.MAX_IMAGE_PIXELS = limit
        assert decode_image(data).shape == (200, 300, 3)
