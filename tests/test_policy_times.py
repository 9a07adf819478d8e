"""The policy's instants in decisions and reasons are formatted by integer arithmetic (ledger.policy._civil, for
speed); they must read exactly as datetime's strftime writes them."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest

from ledger.policy import _civil, _iso, _utc

EDGES = [
    0, 1, 59, 3599, 86399, 86400,
    951_782_400,        # 2000-02-29 00:00:00 (a leap day of a year divisible by 400)
    951_868_799,        # 2000-02-29 23:59:59
    4_107_542_399,      # 2100-02-28 23:59:59 (2100 is not a leap year)
    4_107_542_400,      # 2100-03-01 00:00:00
    1_798_761_599,      # 2026-12-31 23:59:59
    -1, -86_400,        # before the epoch
    -30_610_224_000,    # 1000-01-01 00:00:00, the first instant with four-digit years
    253_402_300_799,    # 9999-12-31 23:59:59, the last
]


@pytest.mark.parametrize("t", EDGES)
def test_edges_read_as_strftime(t):
    dt = datetime.fromtimestamp(t, tz=timezone.utc)
    assert _iso(t) == dt.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert _utc(t) == f"{dt:%Y-%m-%d %H:%M:%S}"


def test_hand_computed_instants():
    assert _iso(1_793_606_400) == "2026-11-02T08:00:00Z"
    assert _utc(951_868_799) == "2000-02-29 23:59:59"
    assert _civil(4_107_542_400) == (2100, 3, 1, 0, 0, 0)


def test_random_instants_read_as_strftime():
    rng = random.Random(4)
    for _ in range(20_000):
        t = rng.randrange(-30_610_224_000, 253_402_300_800)
        dt = datetime.fromtimestamp(t, tz=timezone.utc)
        assert _iso(t) == dt.strftime("%Y-%m-%dT%H:%M:%SZ"), t
        assert _utc(t) == f"{dt:%Y-%m-%d %H:%M:%S}", t


def test_years_outside_four_digits_fall_back_to_datetime():
    t = -30_610_224_001  # 0999-12-31 23:59:59: strftime's %Y is platform-dependent there, so it decides
    assert _civil(t) is None
    dt = datetime.fromtimestamp(t, tz=timezone.utc)
    assert _iso(t) == dt.strftime("%Y-%m-%dT%H:%M:%SZ")
