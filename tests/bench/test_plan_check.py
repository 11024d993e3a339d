"""bench.plan_check plans each recorded run as it ran: the post-balancing its log shows."""

from __future__ import annotations

import json

from bench.plan_check import as_it_ran


def _run(tmp_path, name, history):
    out = tmp_path / name
    out.mkdir()
    (out / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return {"odb_enable": True, "output_dir": str(out)}


def test_as_it_ran_reads_the_balancer_figures_from_the_log(tmp_path):
    balanced = _run(tmp_path, "balanced", [{"loss": 1.0, "odb/balance_max_over_lb": 1.02}, {"eval_loss": 2.0}])
    unbalanced = _run(tmp_path, "unbalanced", [{"loss": 1.0, "odb/padding_efficiency": 1.0}])
    assert as_it_ran(balanced)["odb_balance"] is True
    assert as_it_ran(unbalanced)["odb_balance"] is False
    # an explicit key, and Standard, stand as written (no log read)
    assert as_it_ran({"odb_enable": True, "odb_balance": False, "output_dir": "/absent"})["odb_balance"] is False
    assert as_it_ran({"per_device_train_batch_size": 1}) == {"per_device_train_batch_size": 1}
