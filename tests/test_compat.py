"""Upgrade safety: every private Ray and DeepSpeed name the product uses lives in pipelines/compat/ (one module per
library), each still resolves with the installed versions, those versions are the ones constraints.txt pins (and
pyproject, ray_cluster.yaml name), and no module elsewhere names a private one. An upgrade that moves a name fails
here, in `make test-fast`, rather than in a preemption. Nothing here starts Ray or trains."""
from __future__ import annotations

import ast
import importlib.metadata
import logging
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from pipelines.compat import deepspeed_private, ray_private, resolve
from tests.pace import scaled

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "pipelines" / "compat"
MODULES = {"ray": ray_private, "deepspeed": deepspeed_private}
# Where the product's code lies: none of it names a private Ray or DeepSpeed name outside pipelines/compat/.
SCANNED = ("pipelines", "models", "jobs", "benchmarks", "studies")
# Files that still name private names, to move behind pipelines/compat/. Only shrinks: a file
# listed here that no longer names one fails too.
KNOWN: set[str] = set()
# DeepSpeed's internals without an underscore in their names.
DEEPSPEED_INTERNAL = ("deepspeed.runtime", "deepspeed.checkpoint", "deepspeed.utils.tensor_fragment",
                      "deepspeed.ops.op_builder", "deepspeed.comm.torch")
DOTTED = re.compile(r"\b(?:ray|deepspeed)(?:\.\w+)+")
# Private names of Ray's that are not dotted: the resource Ray gives the head node.
PRIVATE_STRINGS = ("__internal_head__",)


def is_private(dotted: str) -> bool:
    """Whether a dotted name of Ray or DeepSpeed is private: a part with a leading underscore (not a dunder such as
    __version__, except DeepSpeed's op table), Ray's generated protobufs, or one of DEEPSPEED_INTERNAL."""
    parts = dotted.split(".")
    if parts[0] not in ("ray", "deepspeed"):
        return False
    if any(p == "__compatible_ops__" or (p.startswith("_") and not (p.startswith("__") and p.endswith("__")))
           for p in parts):
        return True
    return any(dotted == d or dotted.startswith(d + ".") for d in ("ray.core.generated", *DEEPSPEED_INTERNAL))


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_names_in(source: str) -> set[str]:
    """The private Ray / DeepSpeed names a Python source names: imported, reached through attributes of `ray` or
    `deepspeed`, written as a dotted string (a logger's or a class's name), and any `._config` (a DeepSpeed
    engine's private config)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Attribute):
            if node.attr == "_config":
                found.add(f"{_chain(node) or '<expression>._config'}")
            names = [_chain(node) or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {node.value for s in PRIVATE_STRINGS if s in node.value}
            names = [node.value] if DOTTED.fullmatch(node.value) else []
        else:
            continue
        found |= {n for n in names if is_private(n)}
    return found


def private_names_in_text(text: str) -> set[str]:
    """The private Ray / DeepSpeed dotted names a config file (YAML) names outside its comments."""
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    return {m.group(0) for line in lines for m in DOTTED.finditer(line) if is_private(m.group(0))}


def product_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".yaml", ".yml")
                  and COMPAT not in p.parents and "__pycache__" not in p.parts)


def private_uses() -> dict[str, set[str]]:
    out = {}
    for path in product_files():
        text = path.read_text()
        found = private_names_in(text) if path.suffix == ".py" else private_names_in_text(text)
        if found:
            out[str(path.relative_to(ROOT))] = found
    return out


@pytest.mark.parametrize("name", [*ray_private.PRIVATE_NAMES, *deepspeed_private.PRIVATE_NAMES])
def test_every_private_name_resolves(name):
    resolve(name)


@pytest.mark.parametrize("library", sorted(MODULES))
def test_what_the_compat_functions_rely_on_holds(library):
    assert MODULES[library].problems() == []


@pytest.mark.parametrize("library", sorted(MODULES))
def test_each_compat_module_lists_every_private_name_it_uses(library):
    """PRIVATE_NAMES is what the check resolves: a private name a function imports must be listed there."""
    module = MODULES[library]
    listed = [name.replace(":", ".") for name in module.PRIVATE_NAMES]
    used = private_names_in(Path(module.__file__).read_text()) - {"engine._config"}
    unlisted = sorted(u for u in used if not any(
        entry == u or entry.startswith(u + ".") or (":" not in name and u.startswith(entry + "."))
        for name, entry in zip(module.PRIVATE_NAMES, listed)))
    assert not unlisted, f"{module.__name__} uses private names its PRIVATE_NAMES does not list: {unlisted}"


# In a fresh Python (imports are per process): DeepSpeed's Muon module imported as a training engine's build does,
# torch.compile recorded instead of run.
DEFERRED_MUON = """
import sys, torch
from pipelines.compat.deepspeed_private import import_muon_with_deferred_compile
import_muon_with_deferred_compile()
compiled = []
torch.compile = lambda fn, **options: compiled.append(fn.__name__) or fn
from deepspeed.runtime.zero.muon import original_muon as muon
loaded = "torch._inductor.compile_fx" in sys.modules
g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
first = muon.zeropower_via_newtonschulz5(g, 5)
again = muon.zeropower_via_newtonschulz5(g, 5)
plain = muon.zeropower_via_newtonschulz5.__wrapped__(g, 5)
print(loaded, compiled, bool(torch.equal(first, plain) and torch.equal(again, plain)))
"""


def test_deepspeeds_muon_kernels_are_compiled_at_their_first_call_not_at_import():
    """ZeRO imports DeepSpeed's Muon optimizer at every rank's first step; its kernels' torch.compile wrappers
    would load torch._inductor (a CPU-second a training process). Deferred: nothing of inductor loaded, and the first
    call compiles the kernel, once, with the same result."""
    out = subprocess.run([sys.executable, "-c", DEFERRED_MUON], cwd=ROOT, capture_output=True, text=True,
                         timeout=scaled(120))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "False ['zeropower_via_newtonschulz5'] True", out.stdout


def test_no_private_name_outside_the_compat_modules():
    found = private_uses()
    new = {path: sorted(names) for path, names in sorted(found.items()) if path not in KNOWN}
    assert not new, f"private Ray / DeepSpeed names outside pipelines/compat/ (put each behind a function there): {new}"
    gone = sorted(KNOWN - set(found))
    assert not gone, f"no longer naming private names, delete from KNOWN: {gone}"


def test_the_scan_catches_what_it_looks_for():
    source = """
import ray._private.state
from ray.train.v2._internal.execution.context import get_train_context
from ray.core.generated import autoscaler_pb2
from deepspeed.runtime.zero.config import ZeroStageEnum
from ray import _private
import deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
engine._config.load_universal_checkpoint = True
LOGGER = "ray.train.v2._internal.execution.context"
x = ray._private.worker.global_worker
import ray, deepspeed, ray.train
from deepspeed.utils import safe_get_full_fp32_param
print(ray.__version__, deepspeed.initialize, ray.train.report, "ray.train is public")
head = "node:__internal_head__" in resources
"""
    assert private_names_in(source) == {
        "ray._private.state", "ray.train.v2._internal.execution.context",
        "ray.train.v2._internal.execution.context.get_train_context", "ray.core.generated",
        "ray.core.generated.autoscaler_pb2", "deepspeed.runtime.zero.config",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "ray._private", "deepspeed.ops.__compatible_ops__", "engine._config", "ray._private.worker",
        "ray._private.worker.global_worker", "node:__internal_head__"}
    assert private_names_in_text("  class: ray.data._internal.logging.SessionFileHandler\n"
                                 "# ray._private.log in a comment\n  (): pipelines.compat.ray_private.f\n") == {
        "ray.data._internal.logging.SessionFileHandler"}


def test_the_ray_data_logging_config_names_resolve():
    """The factories ray_data_logging.yaml names in place of Ray Data's private classes exist."""
    text = (ROOT / "pipelines" / "cluster" / "ray_data_logging.yaml").read_text()
    config = yaml.safe_load(text)
    named = [f["()"] for f in config["filters"].values()] + [h["class"] for h in config["handlers"].values()]
    assert named and all(callable(resolve(":".join(n.rsplit(".", 1)))) for n in named)


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = (s.strip() for s in line.split("==", 1))
            out[name.lower()] = version
    return out


@pytest.mark.parametrize("library", sorted(MODULES))
def test_the_installed_versions_are_the_pinned_ones(library):
    pinned = pins()
    assert library in pinned, f"constraints.txt pins no {library}"
    assert importlib.metadata.version(library) == pinned[library], (
        f"{library} {importlib.metadata.version(library)} installed, constraints.txt pins {pinned[library]}: "
        f"run tests/test_compat.py against the new version and move the pin with pipelines/compat/")
    requirements = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                    ["dependencies"]]
    (requirement,) = [r for r in requirements if r.name.lower() == library]
    assert requirement.specifier.contains(pinned[library]), f"pyproject's {requirement} excludes the pinned version"


def test_the_cluster_config_installs_the_pinned_versions():
    pinned = pins()
    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    assert config["docker"]["image"].startswith(f"rayproject/ray:{pinned['ray']}-")
    setup = " ".join(config["setup_commands"])
    assert re.search(rf"ray\[[\w,]+\]=={re.escape(pinned['ray'])}\b", setup), setup
    assert f"deepspeed=={pinned['deepspeed']}" in setup, setup


def test_outside_a_ray_train_worker_there_is_no_notice_and_nothing_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger=ray_private.__name__):
        assert ray_private.worker_preemption_info() is None
        assert ray_private.set_worker_preemption_info("ab" * 28, rank=0, deadline_ms=None) is None
    assert not caplog.records


def test_a_failure_to_read_the_notice_is_logged_once(monkeypatch, caplog):
    """A moved name must not stop training (the notice is read every step) nor pass unseen: one warning."""
    def moved():
        raise ImportError("cannot import name 'get_train_context' (test)")

    monkeypatch.setattr(ray_private, "_train_context", moved)
    with caplog.at_level(logging.WARNING, logger=ray_private.__name__):
        assert [ray_private.worker_preemption_info() for _ in range(3)] == [None] * 3
    assert len(caplog.records) == 1 and "get_train_context" in caplog.records[0].getMessage()


def test_the_preemption_deadline_is_ray_trains():
    assert ray_private.default_preemption_deadline_s() == 120.0  # Ray 2.60's; a change is worth a look


def test_a_job_says_at_its_start_what_an_untested_ray_breaks(monkeypatch, capsys):
    """`say_problems` (Launch.start_ray): nothing with the tested Ray; a private name gone (as an upgrade moves one)
    is one line naming it and the version."""
    from pipelines.compat import say_problems

    assert say_problems("ray_private", "ray") == [] and capsys.readouterr().out == ""
    monkeypatch.setattr(ray_private, "PRIVATE_NAMES", [*ray_private.PRIVATE_NAMES, "ray.train:_moved_away"])
    [problem] = say_problems("ray_private", "ray")
    [line] = capsys.readouterr().out.splitlines()
    assert "ray.train:_moved_away" in problem and line.startswith("[compat] ray 2.") and problem in line
