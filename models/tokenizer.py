"""CLIP BPE tokenizer (open_clip's, which ships its vocabulary)."""
from __future__ import annotations

import importlib.util
import signal
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # open_clip's tokenizer imports torch when it is first used: unpickling a data pipeline does not
    import torch

VOCAB_SIZE = 49408
EOT_TOKEN = 49407
_MODULE = "_probvlp_open_clip_tokenizer"
_LOAD_LOCK = threading.Lock()


@contextmanager
def _interrupt_after():
    """Hold a KeyboardInterrupt until the block is done. Ray cancels a task (an epoch or a run ending, a worker group
    resized) with one in the worker's main thread; landing inside the first `import torch`, it leaves torch's C++
    operator registry half filled, and every later import of torch in that worker process fails or crashes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # only the main thread's Python-level handler can be swapped
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _tokenizer_module():
    """open_clip's tokenizer module. Its package __init__ imports every open_clip model (timm included,
    ~3 s), which a Ray Data worker that only tokenizes should not pay: the module has no relative
    imports, so it is loaded from its file alone; if that ever fails, through the package."""
    with _LOAD_LOCK, _interrupt_after():  # a thread that finds the module registered must not see it half made
        if "open_clip.tokenizer" in sys.modules:
            return sys.modules["open_clip.tokenizer"]
        if _MODULE in sys.modules:
            return sys.modules[_MODULE]
        source = f"{importlib.util.find_spec('open_clip').submodule_search_locations[0]}/tokenizer.py"
        try:
            spec = importlib.util.spec_from_file_location(_MODULE, source)
            module = importlib.util.module_from_spec(spec)
            sys.modules[_MODULE] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                # What `import` does: a module whose code stopped part way leaves sys.modules (left registered
                # half made, every later task of that worker process failed on it).
                sys.modules.pop(_MODULE, None)
                raise
            return module
        except Exception:  # noqa: BLE001 - a future open_clip layout: take the slow, sure path
            import open_clip.tokenizer

            return open_clip.tokenizer


@lru_cache(maxsize=4)
def _tokenizer(context_length: int):
    return _tokenizer_module().SimpleTokenizer(context_length=context_length)


def tokenize(texts: list[str], context_length: int) -> torch.Tensor:
    """(N, context_length) int64 token ids: [SOT] ... [EOT] 0-padded, truncated to fit (EOT kept)."""
    return _tokenizer(context_length)([str(t) for t in texts], context_length=context_length)
