"""The collector's tuning (training/gc_tuning.py): a larger young generation, a user's own
larger threshold or a collector turned off left as they are."""

from __future__ import annotations

import gc

import pytest

from training.gc_tuning import YOUNG_GENERATION, tune_collector


@pytest.fixture(autouse=True)
def _thresholds_restored():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((700, 10, 10), (YOUNG_GENERATION, 10, 10)),  # Python's default
        ((50_000, 5, 20), (50_000, 5, 20)),  # set larger already: kept
        ((0, 10, 10), (0, 10, 10)),  # collection turned off: kept off
    ],
)
def test_the_young_generation_grows_to_the_tuned_size_and_no_smaller(before, after):
    gc.set_threshold(*before)
    tune_collector()
    assert gc.get_threshold() == after
