import sys

sys.path.insert(0, "/app")

from stats import mean, median


def test_odd_length():
    assert median([3, 1, 2]) == 2


def test_even_length():
    assert median([4, 1, 3, 2]) == 2.5


def test_single():
    assert median([7]) == 7


def test_mean_still_works():
    assert mean([1, 2, 3, 4]) == 2.5
