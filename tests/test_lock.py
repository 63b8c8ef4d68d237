"""The installed environment is requirements.lock's: every locked package at its locked version and nothing else
installed but pip and the project; the lock still satisfies pyproject.toml (its dependencies and the dev extra) and
constraints.txt. A package installed or upgraded by hand, or a pyproject edit without `make lock`, fails here, in
`make test-fast`, rather than as a test set CI never ran. Nothing here starts Ray."""
from __future__ import annotations

import importlib.metadata
import re
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
# What the Makefile installs beside the lock: pip (constraints.txt pins it) and the project, editable, without deps.
BESIDE_THE_LOCK = {"pip", "probvlp"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
PUT_BACK = ("`rm .venv/.installed && make install` puts the lock's versions back; to move the lock instead, "
            "`make lock` (after editing pyproject.toml / constraints.txt) or `make lock-upgrade`")


def pinned(text: str) -> dict[str, str]:
    """A requirements file's `name==version` lines (its comments and annotations skipped)."""
    return {canonicalize_name(m.group(1)): m.group(2) for line in text.splitlines() if (m := PIN.match(line))}


def locked() -> dict[str, str]:
    return pinned(LOCK.read_text())


def constraints() -> dict[str, str]:
    return pinned("\n".join(line.split("#", 1)[0].strip() for line in (ROOT / "constraints.txt").read_text()
                            .splitlines()))


def installed() -> dict[str, str]:
    """What pip installed in this environment's site-packages, read there: sys.path is no guide once Ray is imported
    (it puts its vendored colorama and psutil in front)."""
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}


def installed_version(name: str) -> str | None:
    return installed().get(canonicalize_name(name))


def drift(lock: dict[str, str]) -> list[str]:
    """Each locked package that is not installed at its locked version, as a line."""
    out, present = [], installed()
    for name, version in sorted(lock.items()):
        have = present.get(name)
        if have != version:
            out.append(f"{name}: locked {version}, {'not installed' if have is None else f'installed {have}'}")
    return out


def test_every_locked_package_is_installed_at_its_locked_version():
    lock = locked()
    assert len(lock) > 100, f"{LOCK.name} pins only {len(lock)} packages"
    found = drift(lock)
    assert not found, f"the environment drifted from {LOCK.name}: {found}; {PUT_BACK}"


def test_nothing_is_installed_that_the_lock_does_not_name():
    lock = locked()
    extra = sorted(installed().keys() - lock.keys() - BESIDE_THE_LOCK)
    assert not extra, f"installed but not in {LOCK.name}: {extra}; {PUT_BACK}"


def test_the_lock_satisfies_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = locked()
    wrong = []
    for requirement in map(Requirement, [*project["dependencies"], *project["optional-dependencies"]["dev"]]):
        version = lock.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            wrong.append(f"{requirement}: locked {version}")
    assert not wrong, f"pyproject.toml changed since {LOCK.name} was compiled: {wrong}; run `make lock`"


def test_the_lock_and_the_environment_hold_the_constraints_pins():
    """torch, Ray, DeepSpeed, faiss in the lock at constraints.txt's versions; pip, installed beside the lock, too
    (pip-tools and uv live in the Makefile's tools venv)."""
    lock = locked()
    wrong = []
    for name, version in sorted(constraints().items()):
        if name in lock:
            if lock[name] != version:
                wrong.append(f"{name}: constraints.txt {version}, {LOCK.name} {lock[name]}")
        elif name in BESIDE_THE_LOCK and installed_version(name) != version:
            wrong.append(f"{name}: constraints.txt {version}, installed {installed_version(name)}")
    assert not wrong, f"{wrong}; run `make lock` (then `make install`)"
    assert {"torch", "ray", "deepspeed"} <= constraints().keys() & lock.keys()


def test_a_package_at_another_version_than_the_lock_is_caught():
    """The check above on the lock with one pin moved and one package added: both named, nothing else read."""
    lock = locked()
    text = re.sub(r"^numpy==\S+", "numpy==1.0.0", LOCK.read_text(), count=1, flags=re.M) + "not-a-real-package-xyz==1.0\n"
    changed = {name: version for name, version in pinned(text).items() if lock.get(name) != version}
    assert changed == {"numpy": "1.0.0", "not-a-real-package-xyz": "1.0"}
    assert drift(changed) == ["not-a-real-package-xyz: locked 1.0, not installed",
                              f"numpy: locked 1.0.0, installed {installed_version('numpy')}"]
