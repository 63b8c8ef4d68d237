"""The checkout guard (tests/conftest.py, pytest_sessionfinish): a pytest run that writes into the checkout fails,
naming what it wrote; one that writes nothing there passes, caches and all."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.conftest import checkout_state
from tests.helpers import written_between
from tests.pace import scaled
from tests.small_runs import ROOT


def run_pytest_on(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """pytest in a process of its own, with the suite's conftest as a plugin, on one test of `body` kept outside the
    checkout (a file written into it by this test would be the outer run's own write)."""
    test = tmp_path / "test_generated.py"
    test.write_text(f"from pathlib import Path\n\n\ndef test_generated():\n    {body}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(120))


def test_a_run_that_writes_into_the_checkout_fails_naming_what_it_wrote(tmp_path):
    name = f"written_by_a_test_{uuid.uuid4().hex[:12]}"
    try:
        run = run_pytest_on(tmp_path, f"Path({str(ROOT / name)!r}).mkdir(); "
                                      f"Path({str(ROOT / name / 'file.txt')!r}).write_text('x')")
    finally:
        (ROOT / name / "file.txt").unlink(missing_ok=True)
        if (ROOT / name).exists():
            (ROOT / name).rmdir()
    assert run.returncode == 1, run.stdout[-3000:]
    assert "1 passed" in run.stdout  # the test itself passed: the run fails on what it left in the checkout
    assert f"FAILED: 2 paths written into the checkout ({ROOT})" in run.stdout, run.stdout[-3000:]
    assert f"  {name}\n" in run.stdout and f"  {name}/file.txt\n" in run.stdout


def test_a_run_that_writes_nothing_there_passes(tmp_path):
    run = run_pytest_on(tmp_path, "Path('written_by_no_test').exists()")
    assert run.returncode == 0 and "1 passed" in run.stdout and "written into the checkout" not in run.stdout, \
        run.stdout[-3000:]


def test_the_guard_sees_the_whole_checkout_but_the_environment_git_and_caches(tmp_path):
    for path in ("docs/BENCHMARKS.md", "mlruns/0/meta.yaml", ".venv/lib/x.py", ".git/index", "pipelines/__pycache__/a.pyc",
                 ".pytest_cache/v/x", "stray.txt"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    seen = checkout_state(tmp_path)
    assert {p for p in seen if seen[p] >= 0} == {"docs/BENCHMARKS.md", "mlruns/0/meta.yaml", "stray.txt"}
    os.utime(tmp_path / "docs" / "BENCHMARKS.md", ns=(1, 1))
    (tmp_path / "pipelines" / "new.py").write_text("x")
    assert written_between(seen, checkout_state(tmp_path)) == ["docs/BENCHMARKS.md", "pipelines/new.py"]
