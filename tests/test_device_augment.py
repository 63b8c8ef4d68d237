"""The training augmentation applied three ways from the same draws (float32 reference, uint8 in the reader, batched
tensor ops on the worker's device, here on CPU tensors) gives the same images and the same statistics; uint8 images
(and, for the device, the drawn parameters) are what crosses the object store."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.preprocess import to_model_input
from pipelines.data.augmentation import PARAM_COLUMNS, augment_batch, augment_uint8, device_params
from pipelines.data.device_augment import augment, model_images
from pipelines.data.reader import default_decode_size, read_shards
from tests.test_reader import CONTEXT

SIZE = 48


def photos(n: int, size: int = 56, seed: int = 0) -> list[np.ndarray]:
    """Smooth colour gradients with a bright disc: structure that crops move and colour maps change visibly."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = []
    for _ in range(n):
        a, b, c = rng.random((3, 3))
        img = np.clip(a * xx[..., None] + b * yy[..., None] + 0.3 * c, 0, 1)
        cy, cx, r = rng.uniform(0.2, 0.8, 3) * [size, size, 0.3]
        img[(yy * size - cy) ** 2 + (xx * size - cx) ** 2 < (r * size) ** 2] = rng.random(3)
        out.append((255 * img).astype(np.uint8))
    return out


def on_device(images: list[np.ndarray], seed: int, flip_p: float = 0.0) -> np.ndarray:
    shapes = np.array([im.shape[:2] for im in images])
    params = device_params(shapes[:, 0], shapes[:, 1], np.random.default_rng(seed), flip_p)
    assert params.shape == (len(images), PARAM_COLUMNS) and params.dtype == np.float32
    return augment(torch.from_numpy(np.stack(images)), torch.from_numpy(params), SIZE).numpy()


@pytest.mark.parametrize("flip_p", [0.0, 0.5])
def test_the_same_draws_give_the_same_images_everywhere(flip_p):
    images = photos(64)
    ref = to_model_input(augment_batch(images, SIZE, np.random.default_rng(1), flip_p))
    u8 = to_model_input(augment_uint8(images, SIZE, np.random.default_rng(1), flip_p))
    dev = on_device(images, 1, flip_p)
    assert ref.shape == u8.shape == dev.shape == (64, 3, SIZE, SIZE)
    # one uint8 level is 2/255 ~ 0.008 here; bicubic resamplers differ a little at edges
    assert np.abs(u8 - ref).max() < 0.01
    assert np.abs(dev - ref).mean() < 0.005 and np.abs(dev - ref).mean(axis=(1, 2, 3)).max() < 0.01
    other = to_model_input(augment_batch(images, SIZE, np.random.default_rng(2), flip_p))
    assert np.median(np.abs(other - ref).mean(axis=(1, 2, 3))) > 0.05  # other draws: visibly other images


def statistics(batch: np.ndarray) -> dict[str, float]:
    """Batch-level statistics of (B, 3, H, W) images: mean and spread of brightness and contrast, the share of gray
    images, how far the pictures move (mean over the left third minus the right third)."""
    luma = np.tensordot(np.array([0.299, 0.587, 0.114]), batch, axes=(0, 1))
    chroma = np.abs(batch - batch.mean(axis=1, keepdims=True)).max(axis=(1, 2, 3))
    third = batch.shape[-1] // 3
    shift = luma[..., :third].mean(axis=(1, 2)) - luma[..., -third:].mean(axis=(1, 2))
    return {"mean": luma.mean(), "mean_sd": luma.mean(axis=(1, 2)).std(), "contrast": luma.std(axis=(1, 2)).mean(),
            "gray": (chroma < 0.02).mean(), "shift_sd": shift.std()}


def test_device_augmentation_matches_the_reference_statistics():
    """Independent draws on both sides (other seeds): the distributions agree, not just matched pairs."""
    images = photos(8)
    batch = [images[i % 8] for i in range(400)]
    ref = statistics(to_model_input(augment_batch(batch, SIZE, np.random.default_rng(10), 0.5)))
    dev = statistics(on_device(batch, 20, 0.5))
    plain = statistics(to_model_input(np.stack([im[4:52, 4:52] for im in batch])))
    # tolerances: about 3 standard errors of the difference over 400 images
    assert 0.12 < ref["gray"] < 0.28 and abs(dev["gray"] - ref["gray"]) < 0.09  # p = 0.2
    assert abs(dev["mean"] - ref["mean"]) < 0.06 and abs(dev["contrast"] - ref["contrast"]) < 0.03
    for key in ("mean_sd", "shift_sd"):
        assert abs(dev[key] / ref[key] - 1) < 0.15, key
    # the statistics can tell: jitter spreads the brightness, flips spread the shift
    assert ref["mean_sd"] > 1.2 * plain["mean_sd"] and ref["shift_sd"] > 1.5 * plain["shift_sd"]


def test_unaugmented_uint8_batches_become_the_evaluation_inputs():
    images = np.stack(photos(4, size=SIZE))
    out = model_images({"image": torch.from_numpy(images)}, SIZE)
    assert out.dtype == torch.float32 and torch.equal(out, torch.from_numpy(to_model_input(images)))
    floats = torch.from_numpy(to_model_input(images))
    assert model_images({"image": floats}, SIZE) is floats or torch.equal(model_images({"image": floats}, SIZE), floats)


def write_photo_shards(folder, n: int, per_shard: int = 10) -> tuple[list[str], list[np.ndarray]]:
    """photos() as PNG samples (lossless: a decoded image is the photo) in .tar shards, sample i keyed i."""
    import json

    import cv2
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    images, paths = photos(n), []
    for shard, start in enumerate(range(0, n, per_shard)):
        paths.append(str(folder / f"{shard:05d}.tar"))
        with wds.TarWriter(paths[-1]) as sink:
            for i in range(start, min(n, start + per_shard)):
                png = cv2.imencode(".png", cv2.cvtColor(images[i], cv2.COLOR_RGB2BGR))[1].tobytes()
                sink.write({"__key__": f"{i:06d}", "png": png, "txt": f"caption {i}".encode(),
                            "json": json.dumps({"label": i % 10}).encode()})
    return paths, images


def test_uint8_images_through_the_object_store(ray_local, tmp_path):
    """Read through Ray Data both ways from the same seed (one shard: one batch, so the same draws): uint8 is what
    the object store holds; the device path's images are exactly the decoded photos at the decode size, and the
    images it augments on the worker are the reader path's, row for row (up to the resampling at the decode size:
    at most 0.019 mean |difference| over 20 photo sets in process, against >= 0.16 to another row's image)."""
    from models.preprocess import resize

    paths, photo = write_photo_shards(tmp_path / "shards", 20, per_shard=20)
    size = 16
    images = {}
    for where in ("reader", "device"):
        ds = read_shards(paths, size, CONTEXT, seed=0, augment=True, shuffle=True, stats_name=None, uint8=True,
                         augment_on=where).materialize()
        side = default_decode_size(size) if where == "device" else size
        batch = next(iter(ds.iter_batches(batch_size=20, batch_format="numpy")))
        assert batch["image"].dtype == np.uint8 and batch["image"].shape == (20, side, side, 3)
        assert ("augment" in batch) == (where == "device")
        other_columns = CONTEXT * 8 + 2 * 8 + (PARAM_COLUMNS * 4 if where == "device" else 0)  # tokens, label, id
        assert ds.size_bytes() <= 20 * (3 * side * side + other_columns) * 1.05  # Arrow's offsets and headers
        if where == "device":  # the decoded photo itself, unaugmented
            assert np.array_equal(batch["image"], np.stack([resize(photo[i], side) for i in batch["sample_id"]]))
        torch_batch = next(iter(ds.iter_torch_batches(batch_size=20)))
        order = torch_batch["sample_id"].argsort()
        images[where] = model_images(torch_batch, size)[order].numpy()
        assert torch.equal(torch_batch["sample_id"][order], torch.arange(20))
    assert images["reader"].shape == (20, 3, size, size) and -1 <= images["device"].min() and images["device"].max() <= 1
    diff = np.abs(images["device"] - images["reader"]).mean(axis=(1, 2, 3))
    plain = np.abs(to_model_input(np.stack([resize(p, size) for p in photo])) - images["reader"]).mean(axis=(1, 2, 3))
    print(f"device vs reader per row: mean |diff| <= {diff.max():.4f}; unaugmented vs reader median {np.median(plain):.3f}")
    assert diff.max() < 0.05 and np.median(plain) > 0.05  # the same augmented images, and augmented indeed
