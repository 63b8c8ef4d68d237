"""The reader's uint8 batches made model inputs on the training worker's device, augmented there when the reader
shipped the drawn parameters (`pipelines.data.augmentation.device_params`).

Batched tensor ops, one pass each over the batch: a bicubic crop-and-resize (with the flip folded into the sampling
grid) by `grid_sample`, the crop's mean colour, one batched 3x3 colour map (`baddbmm`), clip, normalise. On a GPU
the reader's CPUs then only decode; the same ops on CPU tensors are what tests/test_device_augment.py compares
against the float reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.preprocess import MEAN, STD


def model_images(batch: dict[str, torch.Tensor], size: int) -> torch.Tensor:
    """(B, 3, size, size) float32 in [-1, 1] from a reader batch (uint8 images, with `augment` parameters or
    without; float32 images pass as they are)."""
    image = batch["image"]
    if image.dtype != torch.uint8:
        return image.float()
    if "augment" in batch:
        return augment(image, batch["augment"], size)
    return normalize(image.permute(0, 3, 1, 2).float())


def normalize(x: torch.Tensor) -> torch.Tensor:
    """0..255 values -> the model's range, with `to_model_input`'s float32 operations."""
    return x.div_(255.0).sub_(MEAN).div_(STD)


def crop_grid(params: torch.Tensor, size: int) -> torch.Tensor:
    """`grid_sample`'s (B, size, size, 2) grid for each sample's crop box (fractions of the image), flipped where
    the flip column is set: output pixel centres spread evenly over the box, as a resize of the crop samples them."""
    b = params.shape[0]
    x0, y0, x1, y1, flip = params[:, :5].unbind(1)
    u = (torch.arange(size, device=params.device, dtype=params.dtype) + 0.5) / size
    ux = torch.where(flip[:, None] > 0.5, 1 - u, u)
    gx = 2 * (x0[:, None] + ux * (x1 - x0)[:, None]) - 1  # align_corners=False: -1 and 1 are the outer edges
    gy = 2 * (y0[:, None] + u * (y1 - y0)[:, None]) - 1
    return torch.stack((gx[:, None, :].expand(b, size, size), gy[:, :, None].expand(b, size, size)), dim=-1)


def augment(image: torch.Tensor, params: torch.Tensor, size: int) -> torch.Tensor:
    """(B, D, D, 3) uint8 + (B, PARAM_COLUMNS) parameters -> (B, 3, size, size) float32 in [-1, 1]."""
    b = image.shape[0]
    params = params.float()
    x = image.permute(0, 3, 1, 2).float()
    crops = F.grid_sample(x, crop_grid(params, size), mode="bicubic", padding_mode="border", align_corners=False)
    crops = crops.clamp_(0, 255).view(b, 3, -1)  # the reference crops in uint8: bicubic overshoot saturates
    a, b0, m = params[:, 5:14].view(b, 3, 3), params[:, 14:17], params[:, 17:26].view(b, 3, 3)
    mean = crops.mean(dim=2) / 255.0
    bias = b0 + torch.bmm(m, mean[:, :, None])[:, :, 0]
    out = torch.baddbmm(bias[:, :, None], a / 255.0, crops).view(b, 3, size, size)
    return out.clamp_(0.0, 1.0).sub_(MEAN).div_(STD)
