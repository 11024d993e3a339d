"""all_to_all_rows: rows carrying ids move to the ranks their send counts name, arrive in
source-rank order, once; the backward sends each row's gradient back to where the row came
from; argument errors and timeouts name the rank and the step."""

from __future__ import annotations

import pytest
import torch

from odb_factory.comm.row_exchange import all_to_all_rows
from tests.helpers.distributed import reported_wait_s, run_world


# ------------------------------------------------------------------ in one process

def test_one_process_returns_a_copy_and_passes_the_gradient_through():
    x = torch.arange(6.0).reshape(3, 2).requires_grad_(True)
    out = all_to_all_rows(x, [3])
    assert torch.equal(out, x.detach()) and out.data_ptr() != x.data_ptr()
    (out * torch.tensor([[1.0, 2.0]])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 2.0]] * 3))


@pytest.mark.parametrize("send,recv,shape,what,message", [
    ([1, 2], None, (3, 4), "embeds", r"^rank 0: send_counts must list 1 non-negative row counts, got \[1, 2\]$"),
    ([-1], None, (3, 4), "embeds", r"^rank 0: send_counts must list 1 non-negative row counts, got \[-1\]$"),
    ([3], [3, 0], (3, 4), "embeds", r"^rank 0: recv_counts must list 1 non-negative row counts, got \[3, 0\]$"),
    ([2], None, (3, 4), "embeds", r"^rank 0: exchange 'embeds': x has 3 rows but send_counts sum to 2$"),
    ([1], None, (), "embeds", r"^rank 0: exchange 'embeds': x has 0 rows but send_counts sum to 1$"),  # a scalar
    ([2], None, (3, 4), None, r"^rank 0: exchange 'rows': x has 3 rows but send_counts sum to 2$"),  # unnamed
])
def test_bad_counts_are_refused_naming_the_rank(send, recv, shape, what, message):
    named = {} if what is None else {"what": what}
    with pytest.raises(ValueError, match=message):
        all_to_all_rows(torch.zeros(shape), send, recv, **named)


@pytest.mark.parametrize("backend,on_cuda", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"),
                                             ("GLOO", "cpu"), ("mpi", "cuda")])
def test_rows_travel_where_the_backend_can_carry_them(monkeypatch, backend, on_cuda):
    # a CUDA tensor crosses a gloo-only group on the CPU; NCCL (alone or beside gloo) takes it as it is.
    # get_backend is replaced: a group of each backend cannot be built on a machine without GPUs
    from odb_factory.comm import row_exchange
    group = object()
    monkeypatch.setattr(row_exchange.dist, "get_backend", lambda g: backend if g is group else "default group")
    want = torch.device("cuda", 1) if on_cuda == "cuda" else torch.device("cpu")
    assert row_exchange._comm_device(group, torch.device("cuda", 1)) == want
    assert row_exchange._comm_device(group, torch.device("cpu")) == torch.device("cpu")


# ------------------------------------------------------------------ real gloo ranks

def counts(world):
    """counts[s][d]: rows rank s sends rank d; rank 0 sends nothing, rank 1 receives nothing."""
    c = [[(2 * s + 3 * d + 1) % 4 for d in range(world)] for s in range(world)]
    for d in range(world):
        c[0][d] = 0
    for s in range(world):
        c[s][1] = 0
    return c


def row_ids(src, dst, k_rows):
    return [1000 * src + 100 * dst + k for k in range(k_rows)]


def _exchange_rank(global_rank, global_world, members):
    import torch
    import torch.distributed as dist

    from odb_factory.comm.row_exchange import all_to_all_rows
    group = dist.new_group(members, backend="gloo")  # every rank takes part in creating it
    if global_rank not in members:
        return None
    rank, world = members.index(global_rank), len(members)  # numbered within the group
    c = counts(world)
    send = c[rank]
    recv = [c[s][rank] for s in range(world)]
    ids = [i for d in range(world) for i in row_ids(rank, d, c[rank][d])]
    # column 0 the id, column 1 a second feature: rows move whole
    x = torch.tensor([[float(i), -0.5 * i] for i in ids], dtype=torch.float64).reshape(-1, 2)
    x.requires_grad_(True)
    out = all_to_all_rows(x, send, recv, group, what="embeds", step=3)
    learned = all_to_all_rows(x.detach(), send, None, group, what="embeds", step=3)  # counts gathered
    exact = all_to_all_rows(torch.tensor(ids, dtype=torch.int64), send, recv, group, what="ids", step=3)
    back = all_to_all_rows(out.detach(), recv, send, group, what="return", step=3)    # reverse exchange
    # the loss weights each received row by its own id: the gradient must come back to the row's origin
    (out * torch.stack([out[:, 0].detach() * 0.25 + 1.0, torch.full_like(out[:, 0], 2.0)], 1)).sum().backward()
    grad_ok = torch.equal(x.grad, torch.stack([x[:, 0].detach() * 0.25 + 1.0, torch.full_like(x[:, 0], 2.0)], 1))
    return {"received": out[:, 0].long().tolist(), "second": out[:, 1].tolist(),
            "learned_same": torch.equal(learned, out.detach()), "exact": exact.tolist(),
            "round_trip": torch.equal(back, x.detach()), "grad_ok": grad_ok,
            "shape": tuple(out.shape), "dtype": str(exact.dtype)}


@pytest.mark.slow
@pytest.mark.parametrize("global_world,members", [(2, [0, 1]), (3, [0, 1, 2]), (3, [1, 2])],
                         ids=["2", "3", "ranks 1-2 of 3"])
def test_rows_reach_the_right_ranks_once_and_gradients_go_back(global_world, members):
    results = run_world(_exchange_rank, global_world, members, timeout=60)
    assert all(r is None for g, r in enumerate(results) if g not in members)
    results = [results[g] for g in members]  # by rank within the group
    world = len(members)
    c = counts(world)
    received = []
    for rank, r in enumerate(results):
        # source-rank order, each source's rows in their order
        want = [i for s in range(world) for i in row_ids(s, rank, c[s][rank])]
        assert r["received"] == want and r["exact"] == want
        assert r["second"] == [-0.5 * i for i in want]
        assert r["shape"] == (len(want), 2) and r["dtype"] == "torch.int64"
        assert r["learned_same"] and r["round_trip"] and r["grad_ok"]
        received += [(rank, i) for i in r["received"]]
    ledger = [(d, i) for s in range(world) for d in range(world) for i in row_ids(s, d, c[s][d])]
    assert sorted(received) == sorted(ledger) and len(set(received)) == len(received)
    assert results[1]["received"] == [] and any(c[s][d] for s in range(world) for d in range(world) if s != d)


def _absent_peer(rank, world):
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from odb_factory.comm import ODBExchangeError
    from odb_factory.comm.row_exchange import all_to_all_rows
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=1.5))  # bounds the count gather
    plain = dist.new_group(backend="gloo")                                  # timeout_s bounds the rows
    graded = dist.new_group(backend="gloo")  # a timeout closes its group's pairs: one group each
    if rank == 1:
        time.sleep(6.0)  # never enters any of the exchanges
        return None
    errors = []
    # the counts gather, the rows, and the rows of a tensor that requires grad (a backward recorded)
    for group, recv, grad in [(short, None, False), (plain, [0, 2], False), (graded, [0, 2], True)]:
        try:
            x = torch.zeros(0, 3, requires_grad=grad)
            all_to_all_rows(x, [0, 0], recv, group, what="probe", step=5, timeout_s=1.5)
        except ODBExchangeError as exc:
            errors.append(str(exc))
        else:
            errors.append("no error")
    return errors


def _absent_in_backward(rank, world):
    """Both ranks exchange rows forward; rank 1 never runs the backward."""
    import time

    import torch

    from odb_factory.comm import ODBExchangeError
    from odb_factory.comm.row_exchange import all_to_all_rows
    x = torch.ones(2, 3, requires_grad=True)
    out = all_to_all_rows(x, [1, 1], [1, 1], what="probe", step=5, timeout_s=1.5)
    if rank == 1:
        time.sleep(4.0)
        return None
    try:
        out.sum().backward()
    except ODBExchangeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_an_absent_peer_times_out_with_an_error_naming_rank_and_step():
    counts_error, rows_error, grad_error = run_world(_absent_peer, 2, timeout=60)[0]
    backward_error = run_world(_absent_in_backward, 2, timeout=60)[0]
    assert counts_error.startswith("ODB exchange 'probe (row counts)' failed on rank 0/2 (step 5) after "), counts_error
    assert rows_error.startswith("ODB exchange 'probe' failed on rank 0/2 (step 5) after "), rows_error
    assert grad_error.startswith("ODB exchange 'probe' failed on rank 0/2 (step 5) after "), grad_error
    assert backward_error.startswith("ODB exchange 'probe (backward)' failed on rank 0/2 (step 5) after "), \
        backward_error
    for text in (counts_error, rows_error, grad_error, backward_error):
        assert "timeout 2s" in text and "timed out" in text.lower() and "every rank must enter every exchange" in text
        assert 1.0 <= reported_wait_s(text) < 30.0, text  # the wait it reports is the wait it did
