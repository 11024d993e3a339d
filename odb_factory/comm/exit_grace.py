"""A moment at exit for Gloo's worker threads to free the tensors of a finished collective.

A Gloo worker thread drops its reference to a collective's tensors after it has woken the
caller. When the caller has already dropped its own (Python) references, that last release
needs the GIL. If the interpreter is finalizing by then, Python stops the thread inside C++
and the process aborts with "terminate called without an active exception", after a
successful run: torchrun reports the rank as failed (SIGABRT). A rank whose last collective
comes milliseconds before exit hits it on a loaded machine; in LLaMA-Factory that is the
final evaluation's gather on a rank that writes nothing afterwards (torch 2.14.1; upstream
discussion: pytorch/pytorch pull request 179291, closed unmerged).

Sleeping in an atexit handler releases the GIL while the interpreter is still whole, so a
waiting worker thread finishes first. It covers collectives the caller waited for (all of
odb-factory's, and those traced in a LLaMA-Factory run); one left running without a wait
could outlast it.
"""

from __future__ import annotations

import atexit
import time

# seconds the exiting main thread sleeps: a waiting worker thread needs microseconds once
# scheduled; the margin is for a loaded machine
GRACE_S = 0.1

_installed = False


def install() -> None:
    """Register the pause at exit, once per process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(time.sleep, GRACE_S)
        _installed = True
