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
    with pytest.raises(AttributeError, match="no attribute 'num_token'"):
        batch.num_token  # noqa: B018
    assert batch.num_samples == 2  # a real property is not routed through the aliases


def test_the_old_orchestrate_package_warns_and_reexports():
    sys.modules.pop("odb_factory.orchestrate", None)
    with pytest.warns(DeprecationWarning, match="odb_factory.orchestrate is deprecated"):
        old = importlib.import_module("odb_factory.orchestrate")
    from odb_factory.balance.vision_plan import plan_vision
    from odb_factory.encoder_stage import VisionBalancer
    assert old.VisionBalancer is VisionBalancer and old.plan_vision is plan_vision
    assert sorted(old.__all__) == sorted(n for n in old.__all__ if hasattr(old, n))
    assert old.gather_objects({"a": 1}, None, "metadata") == [{"a": 1}]  # one process: itself
