"""The interleaved timing of the benchmarks: every system in every position, and right after every other
system, equally often over a whole design (benchmarks._common.williams_order)."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks._common import interleaved, williams_order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_williams_orders_balance_positions_and_predecessors(n):
    design = n if n % 2 == 0 else 2 * n
    rows = [williams_order(n, r) for r in range(design)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    positions = Counter((k, i) for row in rows for i, k in enumerate(row))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    before = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert len(before) == n * (n - 1) and len(set(before.values())) <= 1


def test_interleaved_runs_each_system_once_a_round_in_the_designs_order():
    seen = []
    runs = {name: (lambda i, name=name: seen.append((name, i))) for name in "abcd"}
    times = interleaved(runs, 4, start=10)
    assert all(len(t) == 4 for t in times.values())
    assert [name for name, _ in seen[:4]] == [("abcd"[k]) for k in williams_order(4, 0)]
    assert [i for _, i in seen] == [10] * 4 + [11] * 4 + [12] * 4 + [13] * 4
