"""The import graph of models/, pipelines/ and jobs/, read from the source (ast, nothing imported): no cycles,
no upward imports (models -> pipelines / jobs, pipelines -> jobs), the stages inside pipelines/ in their order,
and studies/ free of tests/. Imports inside functions count too: deferring an import hides a dependency from the
reader, not from the graph."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"models": 0, "pipelines": 1, "jobs": 2}
# pipelines/ by floor: a module imports its own floor or lower ones. The shared ground (config, tracking, the Ray
# runtime, progress lines, plotting, object storage paths, compat: Ray's and DeepSpeed's private names), the data readers,
# downloading, the bundled digits (downloaded, then cut into eval sets), a job's inputs made ready and checked (the
# digits, the eval tasks' data), the training core (fit: the loop, the optimizer, the step's rules, the trainer, the
# fault machinery; no DeepSpeed), DeepSpeed's engine and checkpoints for any stage (zero: nothing of a stage's model,
# data or evaluation), evaluating (whose job prepares its inputs), pretraining (which evaluates), and the two over
# training: tuning (trials are training runs) and the adapter (which trains on a trained model's embeddings).
STAGES = {"config": 0, "compat": 0, "tracking": 0, "storage": 0, "result": 0, "cluster": 0, "console": 0, "plotting": 0,
          "gc_tuning": 0, "data": 1,
          "download": 2, "digits": 3, "inputs": 4, "fit": 4, "digits_fit": 4, "zero": 5, "evaluate": 6, "pretrain": 7,
          "tune": 8, "adapt": 8}
# Upward imports to go: any other upward import fails; one listed here that no longer occurs fails too, so that the
# list only shrinks (empty now: a new upward import is a module in the wrong place).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# studies/ may use the product, never the test suite (none is left to move out of tests/)
KNOWN_STUDY_IMPORTS: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read():
    edges = graph()
    assert "pipelines.pretrain.job" in edges and "pipelines.tracking" in edges["pipelines.pretrain.job"]
    assert "models.registry" in edges["models.model_file"]


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_upward_imports():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in sorted(targets)
              if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert not upward, "imports against the layering models < pipelines < jobs: " + ", ".join(upward)


def stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES[parts[1]] if parts[0] == "pipelines" and len(parts) > 1 else None


def upward_stage_imports(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports inside pipelines/ from a stage to a higher one."""
    unknown = {m.split(".")[1] for m in edges if m.startswith("pipelines.")} - set(STAGES)
    assert not unknown, f"pipelines/ holds {sorted(unknown)}, which STAGES does not place"
    return {(a, b) for a, targets in edges.items() for b in targets
            if stage(a) is not None and stage(b) is not None and stage(b) > stage(a)}


def test_pipelines_stages_import_only_their_floor_or_below():
    found = upward_stage_imports(graph())
    new = [f"{a} -> {b}" for a, b in sorted(found - KNOWN_UPWARD)]
    assert not new, f"imports against the stage order {STAGES}: " + ", ".join(new)
    gone = [f"{a} -> {b}" for a, b in sorted(KNOWN_UPWARD - found)]
    assert not gone, "no longer imported, delete from KNOWN_UPWARD: " + ", ".join(gone)


def study_imports() -> set[tuple[str, str]]:
    """(study module, tests module) for every import of tests/ in studies/."""
    found = set()
    for path in (ROOT / "studies").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            found |= {(name, t) for t in targets if t == "tests" or t.startswith("tests.")}
    return found


def test_studies_do_not_import_the_tests():
    found = study_imports()
    new = [f"{a} -> {b}" for a, b in sorted(found - KNOWN_STUDY_IMPORTS)]
    assert not new, "studies/ imports tests/: " + ", ".join(new)
    gone = [f"{a} -> {b}" for a, b in sorted(KNOWN_STUDY_IMPORTS - found)]
    assert not gone, "no longer imported, delete from KNOWN_STUDY_IMPORTS: " + ", ".join(gone)


def test_the_checks_catch_what_they_look_for():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    edges = {"pipelines.data.reader": {"pipelines.zero.checkpoint_files", "pipelines.config"},
             "pipelines.zero.checkpoint_files": {"pipelines.data.reader", "models.registry"}}
    assert upward_stage_imports(edges) == {("pipelines.data.reader", "pipelines.zero.checkpoint_files")}


# What the stages over training may take from pipelines.pretrain: a sweep runs pretraining jobs (their driver and
# config); the adapter nothing (its loop, optimizer, step and trainer are the training core's, pipelines.fit).
OVER_TRAINING = {"tune": {"pipelines.pretrain.job", "pipelines.pretrain.config"}, "adapt": set()}


def test_the_stages_over_training_take_the_core_not_deepspeeds_internals():
    edges = graph()
    wrong = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                   if a.split(".")[:2] in (["pipelines", "tune"], ["pipelines", "adapt"])
                   and b.startswith("pipelines.pretrain.") and b not in OVER_TRAINING[a.split(".")[1]])
    assert not wrong, "import the training core (pipelines.fit) instead: " + ", ".join(wrong)
    assert any(b.startswith("pipelines.fit.") for b in edges["pipelines.adapt.loop"])


def test_the_training_core_loads_no_deepspeed():
    """In a fresh Python: every module of pipelines/fit/ imported, and DeepSpeed (hence pipelines.zero's engine,
    checkpoints and step) is not among the loaded modules."""
    import subprocess
    import sys

    core = sorted(m for m in modules() if m.startswith("pipelines.fit"))
    assert "pipelines.fit.loop" in core and "pipelines.fit.notices" in core
    edges = graph()
    stage_data = sorted(f"{a} -> {b}" for a in core for b in edges.get(a, ())
                        if b.split(".")[:2] in (["pipelines", "digits"], ["pipelines", "evaluate"]))
    assert not stage_data, f"the training core takes no stage's data nor evaluation: {stage_data}"
    code = ("import importlib, sys\n"
            f"for name in {core!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed' or m.startswith('pipelines.pretrain')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing the training core loaded: {out.stdout.strip()[:500]}"


def test_deepspeeds_pieces_load_no_stage():
    """In a fresh Python: every module of pipelines/zero/ imported (what a new DeepSpeed stage composes), and no
    stage's module is loaded with them: not pretraining's, not the evaluation's, not the digits'."""
    import subprocess
    import sys

    pieces = sorted(m for m in modules() if m.startswith("pipelines.zero"))
    assert "pipelines.zero.checkpoints" in pieces and "pipelines.zero.engine" in pieces
    stages = ("pipelines.pretrain", "pipelines.evaluate", "pipelines.digits", "pipelines.tune", "pipelines.adapt")
    code = ("import importlib, sys\n"
            f"for name in {pieces!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({stages!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1]  # DeepSpeed prints its accelerator's line first
    assert loaded == "[]", f"importing pipelines.zero loaded: {loaded[:500]}"
