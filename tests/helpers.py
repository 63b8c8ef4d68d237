"""Helpers shared by test modules (fixtures live in conftest.py)."""
from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import numpy as np
from PIL import Image

# Steps of the demo CLIP that `trained_clip` trains once per pytest run.
DEMO_STEPS = 600


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, probe, timeout_s: float = 300, every_s: float = 0.5):
    """Poll `probe` until it returns something truthy (returned), or fail after a generous deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s:g}s: {what}")


def registered(run_folder: Path) -> list[str]:
    """Checkpoints Ray Train has registered (listed in its snapshot file), which a restart resumes from. A
    checkpoint folder appears while it is still being written, before that."""
    try:
        snapshot = json.loads((run_folder / "checkpoint_manager_snapshot.json").read_text())
        return [c["checkpoint_dir_name"] for c in snapshot["checkpoint_results"]]
    except (OSError, ValueError, KeyError):  # not written yet, or caught mid-write
        return []


def saved(run_folder: Path) -> list[Path]:
    """Ray Train's checkpoint folders of a run, oldest first."""
    return sorted(p for p in run_folder.glob("checkpoint_*") if p.is_dir())


def jpeg(seed: int, size=(48, 40)) -> bytes:
    """A JPEG of random pixels, the same for the same seed."""
    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


# Deliberately wrong zero-shot prompts: off the digits' domain, no class named (README "Using the uncertainty")
OFF_DOMAIN = ["a photo of a car", "a red bicycle", "a cat sleeping on a sofa", "a bowl of soup",
              "a mountain at sunset"]
