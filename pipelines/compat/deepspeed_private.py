"""Every private DeepSpeed name the product uses (its internals under deepspeed.runtime,
deepspeed.utils.tensor_fragment, deepspeed.checkpoint's converter, deepspeed.ops' op table, an engine's `_config`),
each behind a function. Tested with the DeepSpeed pinned in constraints.txt; tests/test_compat.py resolves every name
of PRIVATE_NAMES and runs `problems()`.

Imports are inside the functions: importing DeepSpeed takes seconds, and a module importing this one (the product's
training worker) decides when it pays that.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import re
import sys
from pathlib import Path

from pipelines.compat import Shortfalls, unresolved

# Every private name below, as "module:attribute.chain"; `from module import attribute` in this file names no other.
PRIVATE_NAMES = (
    "deepspeed.ops",  # its __compatible_ops__, computed on first access (a probe of every op: not resolved here)
    "deepspeed.comm.torch:build_shm_op",
    "deepspeed.ops.op_builder.cpu.comm:ShareMemCommBuilder.NAME",
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
    "deepspeed.runtime.engine:DeepSpeedEngine.load_universal_checkpoint",
    "deepspeed.runtime.config:DeepSpeedConfig",
    "deepspeed.checkpoint.ds_to_universal:main",
    "deepspeed.runtime.compiler:compile",
    "deepspeed.runtime.zero.muon.muon_optimizer:MuonWithAuxAdam",
    "deepspeed.runtime.zero.muon.original_muon",
)
SHM_COMM_OP = "deepspeed_shm_comm"
# ds_to_universal.main's arguments (its command line's, parsed), for a checkpoint without tensor parallelism.
_UNIVERSAL_ARGS = dict(num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                       inject_missing_state=True)


def skip_shm_comm_op_build() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op (`deepspeed_shm_comm`, C++ compiled on first use: about a minute on
    2 CPU cores) incompatible, so that its communication backend skips building it; only its inference all-reduce
    calls it. Public alternative missing: DeepSpeed builds it whenever the probe of `deepspeed.ops.__compatible_ops__`
    finds a compiler, with no setting to say no."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def import_muon_with_deferred_compile() -> None:
    """Import DeepSpeed's Muon optimizer with its `torch.compile` decorators deferred to each function's first call.
    ZeRO-1/2 import it at every rank's first step (ZeRO-3 as it builds its optimizer) to ask whether the optimizer is
    Muon, and the decorators wrap at import, which loads torch._inductor: about a CPU-second in every training
    process, at each launch and restart, for kernels that AdamW (the project's optimizer) never runs; a Muon run
    would still compile each one when it is first called. Public alternative missing: DeepSpeed has no setting
    that defers it."""
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    import torch
    from deepspeed.runtime import compiler

    def deferred(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)
        return call

    decorator = compiler.compile
    compiler.compile = lambda: deferred
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")  # its decorators deferred
    except Exception:  # noqa: BLE001 - a DeepSpeed that calls compile() otherwise (problems() says so in the tests):
        pass  # ZeRO imports the module as DeepSpeed does, at its first step, and the run goes on a second slower
    finally:
        compiler.compile = decorator


def checkpoint_safe_globals() -> list:
    """The DeepSpeed classes a checkpoint's pickles name (the ZeRO stage enum, the loss scalers' state, fragment
    addresses), for torch.load(weights_only=True)'s allow-list. Public alternative missing: DeepSpeed loads its
    checkpoints with weights_only=False and lists no such set."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@functools.cache
def weights_only_checkpoint_engine_class() -> type:
    """DeepSpeed's torch checkpoint engine, loading with torch.load(weights_only=True) and checkpoint_safe_globals
    allowed (no code unpickled). Public alternative missing: DeepSpeed's engine classes and their choice are
    internal."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(checkpoint_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine


def use_weights_only_checkpoint_loading(engine) -> None:
    """Make `engine` (deepspeed.initialize's) load checkpoints through weights_only_checkpoint_engine_class, built from
    the engine's own config. Public alternative missing: no config key selects a checkpoint engine that loads safely."""
    engine.checkpoint_engine = weights_only_checkpoint_engine_class()(engine_config(engine))


def engine_config(engine):
    """The DeepSpeedConfig `engine` was built from (its checkpoint settings and the universal-loading flag). Public
    alternative missing: the engine exposes single getters, not the config object."""
    return engine._config


@contextlib.contextmanager
def loading_universal_checkpoint(engine):
    """Within it, `engine.load_checkpoint` reads DeepSpeed's universal checkpoint format (any data-parallel size);
    saving is unchanged (the flag is read at load time only). Public alternative missing: only the config key
    `checkpoint.load_universal`, fixed when the engine is built."""
    config = engine_config(engine)
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


def convert_to_universal(input_folder: Path, output_folder: Path) -> None:
    """DeepSpeed's conversion of the ZeRO checkpoint in `input_folder` (one tag's folder) to its universal format in
    `output_folder`, in this process with one worker, its prints and progress bars kept out of the output; without
    tensor parallelism the checkpoint lacks universal_checkpoint_info, which inject_missing_state writes. Public
    alternative missing: only the `ds_to_universal.py` command line."""
    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(input_folder=str(input_folder), output_folder=str(output_folder), **_UNIVERSAL_ARGS)
    with contextlib.redirect_stdout(io.StringIO()):
        main(args)


def problems() -> list[str]:
    """What of this module's use of DeepSpeed no longer holds with the installed DeepSpeed, nothing run that acts
    (the op table is not probed): every name of PRIVATE_NAMES resolves, and the shapes the functions rely on are
    there. Empty when all is well."""
    out = Shortfalls(unresolved(PRIVATE_NAMES))
    if out:
        return out
    need = out.need
    import deepspeed.ops
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.config import DeepSpeedConfig

    need("__compatible_ops__" in vars(deepspeed.ops) or "__compatible_ops__" in inspect.getsource(deepspeed.ops),
         "deepspeed.ops has no __compatible_ops__")
    need("__compatible_ops__" in inspect.getsource(build_shm_op),
         "DeepSpeed's shared-memory comm op no longer asks __compatible_ops__ whether to build")
    need(ShareMemCommBuilder.NAME == SHM_COMM_OP, f"the shared-memory comm op is now {ShareMemCommBuilder.NAME!r}")
    muon = importlib.util.find_spec("deepspeed.runtime.zero.muon.original_muon")
    need(muon is not None and "@compiler.compile()" in Path(muon.origin).read_text(),
         "DeepSpeed's Muon kernels are no longer wrapped by deepspeed.runtime.compiler.compile() at import")
    need({"load", "save"} <= set(vars(TorchCheckpointEngine)), "TorchCheckpointEngine no longer defines load / save")
    need(list(inspect.signature(TorchCheckpointEngine.load).parameters) == ["self", "path", "map_location"],
         "TorchCheckpointEngine.load's arguments changed")
    need("load_universal_checkpoint" in inspect.getsource(DeepSpeedConfig),
         "DeepSpeedConfig no longer has load_universal_checkpoint")
    missing = set(re.findall(r"\bargs\.(\w+)", inspect.getsource(ds_to_universal))) - {
        "input_folder", "output_folder", *_UNIVERSAL_ARGS}
    need(not missing, f"ds_to_universal.main reads arguments not given: {sorted(missing)}")
    return out
