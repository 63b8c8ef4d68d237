"""The private names of Ray and DeepSpeed that the product uses, one module per library: `ray_private` and
`deepspeed_private`. Nothing else in pipelines/, models/, jobs/ (nor the tests, outside those testing Ray itself)
imports those names; each sits behind a named function here whose docstring says what it is for and which public
alternative the library lacks.

An upgrade that moves or renames one fails CI, not a preemption: each module's `PRIVATE_NAMES` lists every private
name it resolves and its `problems()` resolves them all without calling any (and checks the few shapes the functions
rely on: fields, signatures, arguments), which tests/test_compat.py runs in `make test-fast` with the versions pinned
in constraints.txt; the same test fails when a module elsewhere names a private Ray or DeepSpeed name.

The functions raise what the library raises, except where a caller needs an answer in every case (a notice of
preemption read each step): there a failure is logged once per distinct failure (`warn_once`) and the function
answers as if the library had nothing to say. Being outside a Ray Train worker is the one quiet case.
"""
from __future__ import annotations

import importlib
import logging

_WARNED: set[tuple[str, str]] = set()


def warn_once(log: logging.Logger, what: str, err: BaseException) -> None:
    """Log `what` failed with `err` (its traceback) the first time this failure (what, error type and text) is seen."""
    key = (what, f"{type(err).__name__}: {err}")
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning("%s failed (%s); an upgrade of the library may have moved a private name (pipelines/compat)",
                what, key[1], exc_info=err)


class Shortfalls(list):
    """What a module's `problems()` found no longer holding: `need(ok, what)` keeps `what` where `ok` is false."""

    def need(self, ok: bool, what: str) -> None:
        if not ok:
            self.append(what)


def resolve(name: str):
    """The object a PRIVATE_NAMES entry names, "module:attr.chain" (or "module" alone), imported, nothing called."""
    module, _, chain = name.partition(":")
    obj = importlib.import_module(module)
    for attr in filter(None, chain.split(".")):
        obj = getattr(obj, attr)
    return obj


def unresolved(names) -> list[str]:
    """The entries of `names` that do not resolve, each with why."""
    out = []
    for name in names:
        try:
            resolve(name)
        except Exception as err:  # reported, not swallowed: this is the check's answer
            out.append(f"{name}: {type(err).__name__}: {err}")
    return out


def say_problems(module_name: str, library: str) -> list[str]:
    """At a job's start: `problems()` of `pipelines.compat.<module_name>` against the installed `library`, one line
    each (what no longer holds, and that the functions built on it answer as if the library had nothing to say, a
    drain's notices unseen, say); the list. Nothing is printed where all holds, the tested versions."""
    from importlib.metadata import version

    found = importlib.import_module(f"pipelines.compat.{module_name}").problems()
    for problem in found:
        print(f"[compat] {library} {version(library)} is not the version this project was tested with: {problem}; "
              "what builds on it is off (pipelines/compat)", flush=True)
    return found
