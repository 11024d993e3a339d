"""Run a function on N real gloo ranks (separate processes) and collect their results."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """This process's environment for a child Python process that imports odb_factory and the
    tests: the checkout after the inherited path (`make mutation` puts its mutated copy first)."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), root])))


# Ranks fork from a forkserver that has imported these (a fresh, single-threaded process, not
# the test process): each rank then starts in milliseconds instead of importing torch anew,
# which costs seconds a rank on a 2-core machine. No test function runs in the server.
# (A module that does not import is left out by the server, as multiprocessing does.)
PRELOAD = ["torch", "torch.distributed", "numpy", "scipy.optimize", "odb_factory",
           "odb_factory.loader", "odb_factory.synthetic",
           "transformers.models.qwen3_vl.modeling_qwen3_vl",            # the encoder-stage tests' models
           "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank, world, port, out_dir, args, environ, cwd):
    # the server's environment and directory are the test process's of when it started
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # report, do not hang the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_world(fn: Callable, world: int, *args, timeout: float = 300.0,
              expect_errors: bool = False, expect_dead: bool = False) -> List[Any]:
    """fn(rank, world, *args) on `world` fresh processes (forked from the forkserver, never
    from the test process, which holds library threads and could deadlock a child); returns the
    per-rank results. A rank that raised yields ("error", text) when expect_errors, else
    the test fails; a rank that died without a result yields ("died", exit code) when
    expect_dead, else the test fails. A rank still running after `timeout` fails the test."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out_dir, args, dict(os.environ),
                                                  os.getcwd()), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
        results = []
        for r in range(world):
            path = Path(out_dir, f"rank{r}.pkl")
            if not path.exists() and expect_dead:
                results.append(("died", procs[r].exitcode))
                continue
            if not path.exists():
                raise AssertionError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            status, value = pickle.loads(path.read_bytes())
            if status == "error" and not expect_errors:
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append((status, value) if expect_errors else value)
        return results


def reported_wait_s(message: str) -> float:
    """The seconds a collective's error message says it waited (comm/errors.describe_failure's
    "... after 1.5s, timeout 2s: ...")."""
    return float(re.search(r" after (-?[0-9.]+)s, timeout ", message).group(1))
