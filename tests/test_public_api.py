"""The public API keeps its promises: every name of `odb_factory.__all__` resolves, and the
names 0.2.0 renamed still work for one minor version, each with a DeprecationWarning that names
its replacement."""

from __future__ import annotations

import importlib
import sys

import pytest

import odb_factory


def test_every_public_name_resolves():
    for name in odb_factory.__all__:
        assert getattr(odb_factory, name) is not None, name
    with pytest.raises(AttributeError):
        odb_factory.not_a_public_name  # noqa: B018


def _batch(**kw):
    from odb_factory import ODBBatch
    fields = dict(data=None, indices=[3, 4], label_tokens=7, global_label_tokens=20, loss_scale=0.5,
                  is_idle=False, epoch=0, step=1, input_tokens=11)
    return ODBBatch(**{**fields, **kw})


@pytest.mark.parametrize("old, new", [("num_tokens", "label_tokens"), ("global_num_tokens", "global_label_tokens"),
                                      ("num_input_tokens", "input_tokens")])
def test_the_old_batch_names_warn_and_answer(old, new):
    batch = _batch()
    with pytest.warns(DeprecationWarning, match=rf"ODBBatch\.{old} is deprecated.*ODBBatch\.{new}"):
        assert getattr(batch, old) == getattr(batch, new)
    with pytest.raises(AttributeError, match="^'ODBBatch' object has no attribute 'num_token'$"):
        batch.num_token  # noqa: B018
    assert batch.num_samples == 2  # a real property is not routed through the aliases


def test_an_old_batch_name_warns_at_the_line_that_reads_it():
    with pytest.warns(DeprecationWarning) as caught:
        _batch().num_tokens  # noqa: B018
    line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_the_old_orchestrate_package_warns_and_reexports():
    sys.modules.pop("odb_factory.orchestrate", None)
    with pytest.warns(DeprecationWarning, match="odb_factory.orchestrate is deprecated"):
        old = importlib.import_module("odb_factory.orchestrate")
    from odb_factory.balance.vision_plan import plan_vision
    from odb_factory.encoder_stage import VisionBalancer
    assert old.VisionBalancer is VisionBalancer and old.plan_vision is plan_vision
    assert sorted(old.__all__) == sorted(n for n in old.__all__ if hasattr(old, n))
    assert old.gather_objects({"a": 1}, None, "metadata") == [{"a": 1}]  # one process: itself


def test_the_old_dry_run_package_warns_and_answers_with_the_new_modules():
    for name in [m for m in sys.modules if m == "odb_factory.plan" or m.startswith("odb_factory.plan.")]:
        sys.modules.pop(name)
    with pytest.warns(DeprecationWarning, match=r"odb_factory\.plan is deprecated: use odb_factory\.dry_run"):
        importlib.import_module("odb_factory.plan")
    from odb_factory.dry_run import speedup
    from odb_factory.plan.speedup import model_spec  # a user's old import
    assert model_spec is speedup.model_spec


def test_the_old_dry_run_command_still_runs_and_says_the_new_one():
    import subprocess
    done = subprocess.run([sys.executable, "-m", "odb_factory.plan", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "python -m odb_factory.dry_run" in done.stdout
    assert "odb_factory.plan is deprecated: use python -m odb_factory.dry_run" in done.stderr


@pytest.mark.parametrize("old, new", [("transformers_qwen3_vl", "qwen3_vl_patch"),
                                      ("transformers_qwen2_5_omni", "qwen2_5_omni_patch")])
def test_the_old_encoder_patch_modules_warn_and_are_the_moved_ones(old, new):
    sys.modules.pop(f"odb_factory_patches.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"odb_factory_patches\.{old} is deprecated: import "
                                                rf"odb_factory\.encoder_stage\.{new}"):
        moved = importlib.import_module(f"odb_factory_patches.{old}")
    assert moved is importlib.import_module(f"odb_factory.encoder_stage.{new}")
    assert callable(moved.apply) and callable(moved.remove)


def test_the_old_token_cap_keyword_of_balance_warns_and_caps_the_same():
    from odb_factory.balance import balance
    kwargs = dict(lengths_per_rank=[[10, 2], []], tolerance=None)
    new = balance([[10.0, 2.0], []], 8, "lpt", token_budget=12, **kwargs)
    with pytest.warns(DeprecationWarning, match=r"max_padded_tokens_per_rank=\.\.\.\) is deprecated: use token_budget"):
        old = balance([[10.0, 2.0], []], 8, "lpt", max_padded_tokens_per_rank=12, **kwargs)
    assert old == new and max(new.cost_per_rank) == 10.0
    with pytest.raises(TypeError, match="token_budget and its deprecated name"):
        balance([[1.0]], 8, lengths_per_rank=[[1]], token_budget=4, max_padded_tokens_per_rank=4)
