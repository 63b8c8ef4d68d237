"""Helpers shared by test modules (fixtures live in conftest.py)."""
from __future__ import annotations

import socket

# Steps of the demo CLIP that `trained_clip` trains once per pytest run.
DEMO_STEPS = 600


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
