"""Images as every probvlp model sees them: decoded RGB, resized to the model's size, scaled to [-1, 1].

Shared by the training reader, evaluation and the MLflow model, so a served model gets exactly the
inputs it was trained and evaluated on."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

try:  # optional: libjpeg-turbo's decoder with DCT-domain downscaling; OpenCV decodes everything otherwise
    import simplejpeg
except ImportError:  # pragma: no cover - e.g. a GPU machine's carried packages without it
    simplejpeg = None

if TYPE_CHECKING:
    import torch

MEAN, STD = 0.5, 0.5


def opencv():
    import cv2  # deferred: OpenCV's import costs every Ray worker that never decodes an image

    cv2.setNumThreads(1)
    return cv2


# Decompression-bomb guard, the one place the limit is set: an image whose header announces more pixels is refused
# before any pixel is decoded (training, evaluation and serving alike). PIL's default (Image.MAX_IMAGE_PIXELS,
# ~89.5 M pixels, ~270 MB as RGB); OpenCV's own limit (CV_IO_MAX_IMAGE_PIXELS, 2^30) backs up other formats.
MAX_IMAGE_PIXELS = 89_478_485


class ImageTooLarge(ValueError):
    """An image whose header announces more pixels than MAX_IMAGE_PIXELS (never decoded)."""


def image_dimensions(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG, PNG or WebP header without decoding pixels; None for other or unreadable headers."""
    if data[:2] == b"\xff\xd8":
        if simplejpeg is not None:
            try:
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
                return width, height
            except ValueError:
                return None
        return _jpeg_dimensions(data)
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        chunk = data[12:16]
        if chunk == b"VP8X":
            return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
        if chunk == b"VP8L":
            bits = int.from_bytes(data[21:25], "little")
            return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
        if chunk == b"VP8 ":
            return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    return None


def _jpeg_dimensions(data: bytes) -> tuple[int, int] | None:
    """The frame size of a JPEG's first start-of-frame marker (SOF0-15 but DHT, JPG, DAC)."""
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker, length = data[i + 1], int.from_bytes(data[i + 2 : i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        i += 2 + length
    return None


def decode_image(data: bytes, min_size: int | None = None) -> np.ndarray:
    """Encoded bytes -> HWC uint8 RGB. Raises ValueError on undecodable or truncated data, ImageTooLarge (a
    ValueError) past MAX_IMAGE_PIXELS.

    Every stored form gives the RGB the model trains on: grayscale repeated in 3 channels, 16-bit scaled to 8
    (the high byte, as OpenCV), palette expanded, transparency composited on white (as jobs.download's resizer
    writes it), CMYK converted, a JPEG's EXIF orientation applied (the picture upright, as PIL's exif_transpose).
    min_size: a JPEG may come back smaller than stored, by libjpeg-turbo's DCT scaling (M/8), but with both
    sides >= min_size: a 512 px image decodes at 256 px in about half the time when 224 px is all the model
    needs. None: full size (what evaluation and serving use)."""
    if not data:
        raise ValueError("empty image")
    size = image_dimensions(data)
    if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(f"{size[0]}x{size[1]} pixels, over models.preprocess.MAX_IMAGE_PIXELS "
                            f"({MAX_IMAGE_PIXELS})")
    is_jpeg = data[:2] == b"\xff\xd8"
    if is_jpeg and b"\xff\xd9" not in data[-64:]:
        raise ValueError("truncated JPEG (no end-of-image marker)")  # libjpeg would pad it silently
    # EXIF may rotate the picture: OpenCV applies its orientation, libjpeg-turbo alone would not
    if is_jpeg and simplejpeg is not None and b"Exif\x00\x00" not in data[:65536]:
        try:  # the same libjpeg-turbo settings as OpenCV's (same pixels), ~30% faster here (benchmarks/ingest.py)
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_size or 0, min_width=min_size or 0)
        except ValueError:
            pass  # e.g. CMYK, which OpenCV converts
    cv2 = opencv()
    # JPEG: IMREAD_COLOR applies EXIF orientation (and JPEGs carry no alpha); others: unchanged, to see the alpha
    flags = cv2.IMREAD_COLOR if is_jpeg else cv2.IMREAD_UNCHANGED
    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    except cv2.error as err:  # e.g. over OpenCV's own pixel limit, for a format whose header is not read above
        raise ValueError(f"image decoding error ({str(err).strip().splitlines()[-1]})") from None
    if arr is None:
        raise ValueError("image decoding error")
    return _to_rgb8(arr, cv2)


def _to_rgb8(arr: np.ndarray, cv2) -> np.ndarray:
    """OpenCV's decoded array (gray, BGR or BGRA; 8 or 16 bits) -> HWC uint8 RGB."""
    if arr.dtype == np.uint16:
        arr = (arr >> 8).astype(np.uint8)  # OpenCV's IMREAD_COLOR conversion of 16-bit samples
    elif arr.dtype != np.uint8:
        raise ValueError(f"unsupported sample type {arr.dtype}")
    if arr.ndim == 2:
        return cv2.cvtColor(arr, cv2.COLOR_GRAY2RGB)
    if arr.shape[2] == 4:
        # on white, as jobs.download's resizer (img2dataset) writes transparent images
        alpha = arr[..., 3:].astype(np.float32) / 255
        bgr = np.rint(arr[..., :3] * alpha + 255 * (1 - alpha)).clip(0, 255).astype(np.uint8)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    if arr.shape[2] == 1:
        return cv2.cvtColor(arr, cv2.COLOR_GRAY2RGB)
    return cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)


def resize(arr: np.ndarray, size: int, box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """Optional crop box (x, y, w, h), then bicubic resize to size x size (area when shrinking a lot)."""
    if box is not None:
        x, y, w, h = box
        arr = arr[y : y + h, x : x + w]
    if arr.shape[:2] == (size, size):
        return np.ascontiguousarray(arr)
    cv2 = opencv()
    shrink = min(arr.shape[:2]) >= 2 * size
    return cv2.resize(arr, (size, size), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)


def to_model_input(images) -> np.ndarray:
    """(B, H, W, 3) uint8 images (or a list of them) or floats in [0, 1] -> (B, 3, H, W) float32 in [-1, 1]."""
    batch = np.stack(images) if isinstance(images, (list, tuple)) else images
    # written channel by channel into the channels-first output (no float HWC temporaries), with the same
    # float32 operations in the same order as ((x / 255 - MEAN) / STD): bit for bit the same values
    out = np.empty((batch.shape[0], batch.shape[3], batch.shape[1], batch.shape[2]), np.float32)
    for c in range(batch.shape[3]):
        out[:, c] = batch[..., c]
    if batch.dtype == np.uint8:
        out /= np.float32(255.0)
    out -= np.float32(MEAN)
    out /= np.float32(STD)
    return out


def encoded_to_model_input(encoded: list[bytes], size: int) -> np.ndarray:
    """Encoded images (JPEG, PNG, WebP) -> the model's (B, 3, size, size) input."""
    return to_model_input([resize(decode_image(data), size) for data in encoded])


def encode_png(image: np.ndarray) -> bytes:
    """The inverse of `to_model_input` for one image: (3, H, W) in [-1, 1] -> PNG bytes (exact for images
    that came from uint8 pixels)."""
    rgb = ((image.transpose(1, 2, 0) * STD + MEAN) * 255).round().clip(0, 255).astype(np.uint8)
    cv2 = opencv()
    ok, data = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"could not encode an image of shape {image.shape} as PNG")
    return data.tobytes()


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to `device`: a pinned, non_blocking copy to a GPU (the copy overlaps the host's next work)."""
    if device.type == "cpu" or x.device == device:
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
