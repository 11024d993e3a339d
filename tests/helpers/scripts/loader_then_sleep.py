"""A rank that starts ODB's sample workers on big samples (their results fill the pipe to
this process), takes one step, prints the workers' pids and waits to be killed."""

import multiprocessing
import time

import numpy as np

from odb_factory import ODBConfig, ODBDataLoader


class BigSamples:
    def __len__(self):
        return 64

    def __getitem__(self, index):
        n = 20 + index % 7
        return {"input_ids": list(range(n)), "labels": list(range(n)), "blob": np.ones(2_000_000, np.float32)}


if __name__ == "__main__":
    loader = ODBDataLoader(BigSamples(), ODBConfig(token_budget=64, buffer_size=16, num_workers=2, prefetch_factor=4),
                           collate_fn=lambda batch: None)
    next(iter(loader))
    print("workers", *(p.pid for p in multiprocessing.active_children()), flush=True)
    time.sleep(600)
