"""The command `llamafactory-cli train CONFIG [KEY=VALUE ...]` runs, without the CLI's own process.

Under FORCE_TORCHRUN the CLI spends about 8 s (on a 2-core machine) importing LLaMA-Factory's
environment helpers only to start `torchrun ... llamafactory/launcher.py CONFIG ...`, and once
more shutting down; the tests and benchmarks, which start dozens of runs, start that command
themselves. One process: `python llamafactory/launcher.py CONFIG ...`, what the CLI does in its
own process.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from typing import List, Optional, Sequence


def launcher_path() -> Path:
    spec = importlib.util.find_spec("llamafactory")
    if spec is None or spec.origin is None:
        raise ImportError("LLaMA-Factory is not installed: pip install 'odb-factory[llamafactory]'")
    return Path(spec.origin).parent / "launcher.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_command(args: Sequence[str], nproc: int = 1, script: Optional[Path] = None) -> List[str]:
    """argv that trains `args` (a config path, then optional KEY=VALUE overrides) on `nproc`
    local processes, as `llamafactory-cli train` with FORCE_TORCHRUN=1 NPROC_PER_NODE=nproc
    (`script`: another entry file in place of LLaMA-Factory's launcher)."""
    launcher = str(script or launcher_path())
    if nproc > 1:
        torchrun = Path(sys.executable).parent / "torchrun"
        return [str(torchrun), "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), launcher, *map(str, args)]
    return [sys.executable, launcher, *map(str, args)]
