"""tests/pace.py: the factor every deadline is multiplied by stays within [1, MOST], set or measured."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests import pace
from tests.small_runs import ROOT


@pytest.mark.parametrize("value, factor", [("0.5", 1.0), ("1", 1.0), ("2.5", 2.5), ("4", pace.MOST), ("10", pace.MOST),
                                           ("1e9", pace.MOST), ("inf", pace.MOST)])
def test_the_environments_factor_is_clamped_like_the_calibration(monkeypatch, value, factor):
    monkeypatch.setenv(pace.ENV, value)
    assert pace.slowness() == factor
    assert pace.scaled(60) == 60 * factor


@pytest.mark.parametrize("value, message", [("fast", "expected a number"), ("0", "must be above 0"),
                                            ("-2", "must be above 0"), ("nan", "must be above 0")])
def test_a_factor_that_is_no_positive_number_is_refused(monkeypatch, value, message):
    monkeypatch.setenv(pace.ENV, value)
    with pytest.raises(ValueError, match=message):
        pace.slowness()


def test_a_measured_factor_is_clamped(monkeypatch):
    monkeypatch.delenv(pace.ENV)
    monkeypatch.setattr(pace, "calibrate", lambda: 100 * pace.REFERENCE_S)
    assert pace.slowness() == pace.MOST and pace.os.environ[pace.ENV] == f"{pace.MOST:.2f}"


def test_the_header_says_a_set_factor_was_capped():
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-p", "no:cacheprovider",
                          "tests/test_pace.py::test_a_measured_factor_is_clamped"], cwd=ROOT, capture_output=True,
                         text=True, env={**pace.os.environ, pace.ENV: "10"}, timeout=pace.scaled(120)).stdout
    assert f"deadlines x{pace.MOST:.2f}" in out and f"{pace.ENV}=10 capped at {pace.MOST:g}" in out, out
