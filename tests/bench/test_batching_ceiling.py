"""bench.batching_ceiling's packed side as ODB runs it on CPU: rows of at most the budget, each
sample whole and in order, and the logits of the supervised positions only, which give the loss
and gradients of every position's logits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import batching_ceiling


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=20), row_tokens=st.none() | st.integers(1, 600))
def test_rows_keep_every_sample_whole_in_order_under_the_row_size(lengths, row_tokens):
    rows = batching_ceiling.rows_of(lengths, row_tokens)
    assert [n for row in rows for n in row] == lengths
    assert all(row for row in rows)
    if row_tokens is None:
        assert len(rows) == 1
    else:
        assert all(sum(row) <= row_tokens or len(row) == 1 for row in rows)
        # a row is closed only when the next sample would not fit
        assert all(sum(row) + nxt[0] > row_tokens for row, nxt in zip(rows, rows[1:]))


def test_supervised_logits_only_give_every_positions_gradients():
    """The same seeded step, packed with the supervised positions' logits only and with every
    position's: the same gradients."""
    model = batching_ceiling.build_model(vocab=1024).double()
    grads = []
    for every_logit in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        batching_ceiling.packed(model, [7, 12, 5], row_tokens=16, supervised_share=0.6, every_logit=every_logit)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-9)  # the loss casts logits to fp32
    assert grads[0].abs().sum() > 0
