"""A sample worker that dies is named with its pid, how it died and the rank; a worker that
raises keeps its own error (real DataLoader workers)."""

from __future__ import annotations

import os
import re
import signal
from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader, Dataset

from odb_factory.loader.sample_stage import identity, named_worker_deaths, worker_samples

HINT = "(a crash or the out-of-memory killer; the dataset pipeline may need less memory per worker)"


class Dies(Dataset):
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return 4

    def __getitem__(self, chunk):
        if chunk[0] == 2:
            if self.how == "raise":
                raise ValueError("bad row 2")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        return [(i, f"sample {i}", None) for i in chunk]


def _loader(how):
    return DataLoader(Dies(how), sampler=[[0], [1], [2], [3]], batch_size=None, num_workers=1,
                      collate_fn=identity)


@pytest.mark.parametrize("how, death", [("kill", "was killed by signal 9"), ("exit", "exited with code 1")])
def test_a_dead_sample_worker_is_named(how, death):
    got = []
    with pytest.raises(RuntimeError) as raised:
        for item in worker_samples(_loader(how), rank=3):
            got.append(item[0])
    assert got == [0, 1][:len(got)]   # a dying worker's queue may not have flushed its last chunks
    assert re.fullmatch(rf"sample worker pid \d+ {death} on rank 3 " + re.escape(HINT), str(raised.value))
    assert raised.value.__cause__ is not None           # the DataLoader's own error stays attached


def test_a_worker_that_raises_keeps_its_error():
    with pytest.raises(ValueError, match="bad row 2"):
        list(named_worker_deaths(_loader("raise"), "collate", 0))


def test_an_error_with_no_dead_worker_is_not_renamed():
    def broken():
        yield 1
        raise ConnectionError("the peer hung up")
    with pytest.raises(ConnectionError, match="the peer hung up"):
        list(named_worker_deaths(broken(), "sample", 0))     # a plain iterator has no workers


def test_every_dead_worker_is_named_in_one_message():
    """Two workers gone at once (their pids and exit codes as torch's iterator keeps them);
    one that exited cleanly or still runs is left out."""
    class Iterator:
        _workers = [SimpleNamespace(pid=11, exitcode=-9), SimpleNamespace(pid=12, exitcode=None),
                    SimpleNamespace(pid=13, exitcode=0), SimpleNamespace(pid=14, exitcode=2)]

        def __iter__(self):
            return self

        def __next__(self):
            raise RuntimeError("DataLoader worker exited unexpectedly")

    class Loader:
        def __iter__(self):
            return Iterator()

    with pytest.raises(RuntimeError) as raised:
        list(named_worker_deaths(Loader(), "collate", 1))
    assert str(raised.value) == ("collate worker pid 11 was killed by signal 9, pid 14 exited with code 2 "
                                 "on rank 1 " + HINT)


def _sigchld_handler_kept(rank, world):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, pad_collate
    before = signal.getsignal(signal.SIGCHLD)
    loader = ODBDataLoader(LengthDataset([10] * 8), ODBConfig(token_budget=64), collate_fn=pad_collate,
                           num_workers=1, num_collate_workers=1)
    try:
        return len(list(loader)) > 0 and signal.getsignal(signal.SIGCHLD) is before
    finally:
        loader.close()


def test_the_loader_gives_the_sigchld_handler_back():
    """torch's DataLoader installs a SIGCHLD handler with a process's first workers, which raises
    a dead worker's error wherever the main thread is (inside the user's step, where no peer
    hears of it); the loader starts its workers in the main thread and puts the handler back.
    (A fresh process: torch installs the handler once per process.)"""
    from tests.helpers.distributed import run_world
    assert run_world(_sigchld_handler_kept, 1, timeout=120) == [True]
