"""bench.row_size: rows of whole samples under each size, measured on real gloo ranks in step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench import row_size


@settings(max_examples=200, deadline=None)
@given(pool=st.lists(st.integers(1, 300), max_size=30), tokens=st.integers(1, 900))
def test_a_row_holds_whole_samples_in_order_up_to_its_size(pool, tokens):
    row = row_size.row_of(pool, tokens)
    assert sum(row) <= tokens
    rest = iter(pool)
    assert all(n in rest for n in row)     # a subsequence of the pool, in order
    # a sample is left out only when it did not fit beside those taken before it
    taken = 0
    for n in pool:
        if taken + n <= tokens:
            taken += n
    assert taken == sum(row)


def test_two_ranks_measure_every_size():
    table = row_size.main(["--sizes", "64,200", "--ranks", "2", "--repeats", "2", "--vocab", "1024", "--mean", "40"])
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row")]
    assert [line.split("|")[1].strip() for line in lines] == ["64", "200"]
    for line in lines:
        tokens, seconds, per_token = (float(line.split("|")[i].replace(",", "")) for i in (2, 4, 5))
        assert 0 < tokens and seconds > 0 and abs(per_token - seconds / tokens * 1000) < 1e-3 + per_token * 1e-2
