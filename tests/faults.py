"""Shards with faults put in on purpose, and what a reader must report about them (tests/test_bad_shards.py).

The bundled digits, written straight to webdataset tars (no download), with: good samples in every image form a
user brings (16-bit, RGBA, palette and grayscale PNG, CMYK, EXIF-rotated JPEG, WebP), bad samples of every kind a
reader drops (each with the reason it must be counted under), and broken files (a truncated tar whose first samples
must still be read, a file that is not a tar, an empty one)."""
from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines.data.tars import write_tar


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def exif_rotated_jpeg(image: Image.Image) -> bytes:
    """The image stored turned on its side with EXIF orientation 6 ("rotate 90 clockwise to view"): viewed upright,
    it is `image`."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(image.convert("RGB").transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95, exif=exif.tobytes())


def png16(image: Image.Image) -> bytes:
    import cv2

    arr = np.asarray(image.convert("RGB"), np.uint16) * 257  # 8-bit values widened: x * 257 >> 8 == x
    return cv2.imencode(".png", arr[..., ::-1].copy())[1].tobytes()


def rgba_png(image: Image.Image) -> bytes:
    rgba = image.convert("RGBA")
    alpha = np.full(rgba.size[::-1], 255, np.uint8)
    alpha[:, : alpha.shape[1] // 4] = 0  # a transparent band: composited on white
    rgba.putalpha(Image.fromarray(alpha))
    return encode(rgba, "PNG")


# Every image form that must decode (extension, encoder).
FORMS = {
    "png16": ("png", png16),
    "rgba": ("png", rgba_png),
    "palette": ("png", lambda im: encode(im.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE), "PNG")),
    "gray": ("png", lambda im: encode(im.convert("L"), "PNG")),
    "cmyk": ("jpg", lambda im: encode(im.convert("CMYK"), "JPEG", quality=95)),
    "exif": ("jpg", exif_rotated_jpeg),
    "webp": ("webp", lambda im: encode(im.convert("RGB"), "WEBP", quality=90)),
}


def good_sample(digit, form: str | None = None) -> dict:
    ext, enc = FORMS[form] if form else ("jpg", lambda im: encode(im.convert("RGB"), "JPEG", quality=95))
    return {"__key__": digit.key, ext: enc(digit.image), "txt": digit.meta["captions"]["specific"][0].encode(),
            "json": json.dumps(digit.meta).encode()}


@dataclass(frozen=True)
class Fault:
    reason: str
    sample: dict
    needs: str | None = None  # counted only by a reader that needs this ("caption" / "class"); None: by every reader


def sample_faults(first_key: int, image: Image.Image, eval_only: bool = False) -> list[Fault]:
    """One of each bad sample (keys from first_key on): several per reason where there are several ways to be bad.
    The json carries no captions, so a missing txt means no caption at all."""
    jpeg = encode(image.convert("RGB"), "JPEG", quality=95)
    meta = json.dumps({"label": 3}).encode()
    keys = iter(range(first_key, first_key + 100))

    def s(**files) -> dict:
        return {"__key__": f"{next(keys):06d}", **files}

    faults = [
        Fault("undecodable image", s(jpg=jpeg[: len(jpeg) // 2], txt=b"a truncated jpeg", json=meta)),
        Fault("undecodable image", s(jpg=b"", txt=b"an empty image", json=meta)),
        Fault("undecodable image", s(jpg=b"<html><body>404 Not Found</body></html>", txt=b"html", json=meta)),
        Fault("image too large", s(png=encode(Image.new("L", (12000, 12000)), "PNG"), txt=b"a bomb", json=meta)),
        Fault("no image", s(txt=b"a caption alone", json=meta)),
        Fault("unreadable json", s(jpg=jpeg, txt=b"bad json", json=b"{not json")),
        Fault("unreadable json", s(jpg=jpeg, txt=b"latin-1 json", json='{"label": "é"}'.encode("latin-1"))),
        Fault("no caption", s(jpg=jpeg, json=meta), needs="caption"),
        Fault("no caption", s(jpg=jpeg, txt=b"  \n", json=meta), needs="caption"),
        Fault("caption not UTF-8", s(jpg=jpeg, txt="un caf\xe9".encode("latin-1"), json=meta), needs="caption"),
    ]
    if eval_only:
        faults.append(Fault("no class", s(jpg=jpeg, cls=b"seven", txt=b"a seven"), needs="class"))
    return faults


@dataclass
class Expected:
    """What went into a split: the keys a reader must deliver and what it must report."""

    good: set[str] = field(default_factory=set)  # every sample a reader needing nothing but an image delivers
    faults: list[Fault] = field(default_factory=list)
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # file name -> (reason, samples kept)

    def skipped(self, needs: str | None) -> Counter:
        """Skipped samples by reason for a reader that needs `needs` besides an image."""
        return Counter(f.reason for f in self.faults if f.needs is None or f.needs == needs)

    def delivered(self, needs: str | None) -> set[str]:
        return self.good | {f.sample["__key__"] for f in self.faults if f.needs is not None and f.needs != needs}


def truncated_tar(path: Path, samples: list[dict], keep: int) -> None:
    """`samples` as a tar cut in the middle of sample `keep`'s first file: a reader keeps the `keep` before it."""
    write_tar(path, samples)
    with tarfile.open(path) as tar:
        first = next(m for m in tar.getmembers() if m.name.startswith(samples[keep]["__key__"] + "."))
    data = path.read_bytes()
    path.write_bytes(data[: first.offset_data + first.size // 2])


def write_split(folder: Path, good: list[dict], faults: list[Fault], per_shard: int, broken_files: bool,
                truncated: list[dict] = (), keep: int = 0) -> Expected:
    """Good samples and faults (spread over the shards) as {folder}/NNNNN.tar; with broken_files, also a truncated
    tar of `truncated` keeping `keep`, a file that is not a tar and an empty one."""
    everything = list(good)
    for i, fault in enumerate(faults):  # spread: fault i after good sample i * len(good) / len(faults) (+1)
        everything.insert(1 + i * (len(good) // max(len(faults), 1)) + i, fault.sample)
    for shard, start in enumerate(range(0, len(everything), per_shard)):
        write_tar(folder / f"{shard:05d}.tar", everything[start : start + per_shard])
    expected = Expected({s["__key__"] for s in good}, list(faults))
    if broken_files:
        truncated_tar(folder / "90000.tar", list(truncated), keep)
        expected.good |= {s["__key__"] for s in truncated[:keep]}
        (folder / "90001.tar").write_bytes(b"<!DOCTYPE html><html><body>Access Denied</body></html>\n" * 20)
        (folder / "90002.tar").write_bytes(b"")
        expected.files = {"90000.tar": ("truncated tar", keep), "90001.tar": ("not a tar file", 0),
                          "90002.tar": ("empty file", 0)}
    return expected
