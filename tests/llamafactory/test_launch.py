"""odb_factory.llamafactory.launch starts what `llamafactory-cli train` starts under
FORCE_TORCHRUN: LLaMA-Factory's own launcher file under torchrun, with the CLI's flags."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

pytest.importorskip("llamafactory")

from odb_factory.llamafactory import launch  # noqa: E402


def test_multi_process_command_is_the_clis_torchrun_command():
    import llamafactory.launcher as cli_launcher
    cmd = launch.train_command(["run.yaml", "odb_token_budget=512"], nproc=2)
    assert Path(cmd[0]).name == "torchrun" and Path(cmd[0]).exists()
    assert cmd[-3:] == [cli_launcher.__file__, "run.yaml", "odb_token_budget=512"]
    flags = dict(zip(cmd[1:-3:2], cmd[2:-3:2]))
    assert flags["--nnodes"] == "1" and flags["--node_rank"] == "0" and flags["--nproc_per_node"] == "2"
    assert flags["--master_addr"] == "127.0.0.1" and 0 < int(flags["--master_port"]) < 65536
    # the CLI's own single-node template uses these very flags
    template = inspect.getsource(cli_launcher.launch)
    assert all(flag in template for flag in flags)


def test_one_process_runs_the_launcher_in_this_interpreter():
    import llamafactory.launcher as cli_launcher
    assert launch.train_command(["run.yaml"]) == [sys.executable, cli_launcher.__file__, "run.yaml"]


def test_the_launcher_is_found_or_its_absence_named(monkeypatch):
    import importlib.util
    from types import SimpleNamespace
    found = importlib.util.find_spec
    message = r"^LLaMA-Factory is not installed: pip install 'odb-factory\[llamafactory\]'$"
    for spec in (None, SimpleNamespace(origin=None)):   # not installed; a namespace package of that name
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, spec=spec: spec if name == "llamafactory"
                            else found(name))
        with pytest.raises(ImportError, match=message):
            launch.launcher_path()


def test_the_rendezvous_port_is_one_the_kernel_chose():
    assert all(1024 <= launch._free_port() < 65536 for _ in range(3))
