"""The mutation list (tests/mutants.py) stays true to the tree: every patch applies exactly once, and every test it
names exists. `make test-mutants` runs them."""
from __future__ import annotations

import re

import pytest

from tests.mutants import MUTANTS, ROOT, Mutant


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_patch_applies_once_and_names_existing_tests(mutant: Mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: its text is in {mutant.path} {text.count(mutant.old)} times"
    assert mutant.new != mutant.old and mutant.tests
    for node in mutant.tests:
        file, _, name = node.partition("::")
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (ROOT / file).read_text(), flags=re.M), node


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
