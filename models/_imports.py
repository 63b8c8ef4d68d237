"""Imports of the libraries the models stand on, without the optional integrations they pull in unasked."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def without(*names: str) -> Iterator[None]:
    """Inside, importing any of `names` raises ImportError unless it is imported already, so a library that tries
    them as optional integrations skips them; afterwards they import as usual."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not available" marker
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
