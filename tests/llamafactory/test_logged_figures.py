"""The figures a run writes, computed exactly: the ODB metrics of a log line (from the
window of optimizer steps since the last one), the encoder stages' figures, HF's last-step
flags, and the audit ledger's lines and files. One process, hand-made steps whose every
figure is known."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from transformers import IntervalStrategy, TrainerControl, TrainerState

from odb_factory.balance.audio_plan import plan_audio
from odb_factory.balance.vision_plan import plan_vision
from odb_factory.encoder_stage.audio import AudioBalancer, AudioStepStats
from odb_factory.encoder_stage.vision import VisionBalancer, VisionStepStats
from odb_factory.llamafactory.audit_ledger import AuditLedger, read_ledger, read_rank_ledgers, step_record
from odb_factory.llamafactory.callbacks import ODBCallback
from odb_factory.llamafactory.encoder_metrics import EncoderStageMetrics
from odb_factory.loader.batch import ODBBatch


def _batch(indices, input_tokens, padded_tokens, idle=False, metrics=None, **figures):
    return ODBBatch(data=None, indices=list(indices), label_tokens=0, global_label_tokens=0, loss_scale=1.0,
                    is_idle=idle, epoch=0, step=0, input_tokens=input_tokens, padded_tokens=padded_tokens,
                    metrics=dict(metrics or {}), **figures)


def _callback(audit_dir=None):
    return ODBCallback(lambda: None, progress=None, rank=0, audit_dir=audit_dir, row_of=lambda i: 100 + i,
                       max_steps_from_user=False, num_train_epochs=1.0)


# ---- the log line -----------------------------------------------------------------------

def test_a_window_with_every_figure_logs_each_one_exactly():
    callback = _callback()
    callback.window = {
        "micro_steps": 7.0, "optimizer_steps": 3.0, "samples": 20.0, "global_samples": 41.0,
        "input_tokens": 1000.0, "padded_tokens": 1234.0,
        "balance_max_over_lb_before": 4.0, "balance_max_over_lb": 3.5, "rounds_seen": 3.0,
        "balance_bytes_intra_node": 512.0, "balance_bytes_inter_node": 64.0, "global_grouping_rounds": 2.0,
        "audio_frames": 1000.0, "splits": 1.0, "overflow_groups": 2.0, "over_budget": 3.0, "idle": 4.0,
        "data_wait_s": 0.123456,
    }
    assert callback.pop_log_metrics() == {
        "odb/balance_max_over_lb_before": 1.3333, "odb/balance_max_over_lb": 1.1667,
        "odb/balance_bytes_intra_node": 512.0, "odb/balance_bytes_inter_node": 64.0,
        "odb/global_grouping_rounds": 2.0,
        "odb/audio_frames_per_step": 142.9,
        "odb/padding_efficiency": 0.8104,
        "odb/tokens_per_step": 142.9,
        "odb/samples_per_step": 2.86,
        "odb/micro_steps_per_optimizer_step": 2.33,
        "odb/samples_per_optimizer_step": 13.67,
        "odb/splits": 1.0, "odb/overflow_groups": 2.0, "odb/over_budget_samples": 3.0, "odb/idle_steps": 4.0,
        "odb/data_wait_s": 0.1235,
    }
    assert callback.window == {} and callback.pop_log_metrics() == {}  # the next line starts again


def test_a_window_without_optional_figures_logs_zeros_and_divides_by_one():
    callback = _callback()
    # a balance ratio without a counted round, no optimizer step counted, no padding, no audio
    callback.window = {"micro_steps": 3.0, "balance_max_over_lb": 1.23456, "audio_frames": 0.0,
                       "global_samples": 5.0, "padded_tokens": 8.0}
    assert callback.pop_log_metrics() == {
        "odb/balance_max_over_lb": 1.2346,
        "odb/padding_efficiency": 0.0, "odb/tokens_per_step": 0.0, "odb/samples_per_step": 0.0,
        "odb/micro_steps_per_optimizer_step": 3.0, "odb/samples_per_optimizer_step": 5.0,
        "odb/splits": 0.0, "odb/overflow_groups": 0.0, "odb/over_budget_samples": 0.0, "odb/idle_steps": 0.0,
        "odb/data_wait_s": 0.0,
    }
    callback.window = {"micro_steps": 1.0, "input_tokens": 6.0}   # no padded tokens or samples counted
    logged = callback.pop_log_metrics()
    assert logged["odb/padding_efficiency"] == 0.0 and logged["odb/samples_per_optimizer_step"] == 0.0


def test_the_window_sums_the_steps_figures_and_counts_balanced_rounds():
    callback = _callback()
    first = [_batch([1, 2], 30, 40, metrics={"balance_max_over_lb": 1.5, "splits": 1.0}, audio_frames=7,
                    global_num_samples=5),
             _batch([], 0, 9, idle=True, metrics={"idle": 1.0}, audio_frames=0, global_num_samples=1)]
    second = [_batch([3], 10, 10, metrics={"balance_max_over_lb": 1.25}, audio_frames=2, global_num_samples=3)]
    callback._record(TrainerState(global_step=1), None, first)
    callback._record(TrainerState(global_step=2), None, second)
    assert callback.window == {"balance_max_over_lb": 2.75, "splits": 1.0, "idle": 1.0, "rounds_seen": 2.0,
                               "micro_steps": 3.0, "audio_frames": 9.0, "optimizer_steps": 2.0,
                               "global_samples": 9.0}
    callback._record(TrainerState(global_step=3), None, [])  # an optimizer step whose steps were taken before
    assert callback.window["micro_steps"] == 3.0 and callback.window["optimizer_steps"] == 3.0


# ---- the encoder stages -----------------------------------------------------------------

def _vision_call(balancer, grids_per_rank, pixel_bytes, embed_bytes):
    balancer.step += 1   # as encode() counts its calls before recording them
    balancer._record(VisionStepStats(plan=plan_vision(grids_per_rank, 2, ranks_per_node=2),
                                     pixel_bytes_sent=pixel_bytes, embed_bytes_sent=embed_bytes))


def test_encoder_stage_figures_average_the_calls_since_the_last_line():
    vision, audio = VisionBalancer(), AudioBalancer()
    metrics = EncoderStageMetrics()
    metrics.balancers = [("vision", vision), ("audio", audio)]
    assert metrics.pop() == {}  # no call yet

    skewed = [[(1, 8, 8), (1, 8, 8), (1, 4, 4)], []]
    plans = [plan_vision(skewed, 2, ranks_per_node=2), plan_vision([[(1, 4, 4)], [(1, 4, 4)]], 2,
                                                                     ranks_per_node=2)]
    _vision_call(vision, skewed, pixel_bytes=100, embed_bytes=10)
    _vision_call(vision, [[(1, 4, 4)], [(1, 4, 4)]], pixel_bytes=1, embed_bytes=2)
    vision.step += 1
    vision._record(VisionStepStats(plan=None, dummy=True))  # a call without items: not averaged
    audio_plan = plan_audio([[400, 100], [100]], ranks_per_node=2)
    audio.step += 1
    audio._record(AudioStepStats(plan=audio_plan, frame_bytes_sent=30, embed_bytes_sent=4))
    assert plans[0].max_over_lb_before > plans[1].max_over_lb_before  # the calls differ
    assert plans[0].moved_items, "the skewed call must move an item"

    assert metrics.pop() == {
        "odb/vision_max_over_lb_before": round(sum(p.max_over_lb_before for p in plans) / 2, 4),
        "odb/vision_max_over_lb_after": round(sum(p.max_over_lb_after for p in plans) / 2, 4),
        "odb/vision_moved_items": float(len(plans[0].moved_items) + len(plans[1].moved_items)),
        "odb/vision_bytes_sent": 113.0,
        "odb/audio_max_over_lb_before": round(audio_plan.max_over_lb_before, 4),
        "odb/audio_max_over_lb_after": round(audio_plan.max_over_lb_after, 4),
        "odb/audio_moved_items": float(len(audio_plan.moved_items)),
        "odb/audio_bytes_sent": 34.0,
    }
    assert metrics.pop() == {}  # nothing since

    _vision_call(vision, skewed, pixel_bytes=7, embed_bytes=0)
    assert metrics.pop() == {
        "odb/vision_max_over_lb_before": round(plans[0].max_over_lb_before, 4),
        "odb/vision_max_over_lb_after": round(plans[0].max_over_lb_after, 4),
        "odb/vision_moved_items": float(len(plans[0].moved_items)),
        "odb/vision_bytes_sent": 7.0,
    }
    audio.step += 1
    audio._record(AudioStepStats(plan=audio_plan, frame_bytes_sent=5, embed_bytes_sent=0))
    assert metrics.pop()["odb/audio_bytes_sent"] == 5.0   # nothing new for vision: audio still read
    late = EncoderStageMetrics()   # a first log line after several calls reads them all
    late.balancers = [("audio", audio)]
    assert late.pop()["odb/audio_bytes_sent"] == 34.0 + 5.0


# ---- HF's last step ---------------------------------------------------------------------

@pytest.mark.parametrize("eval_strategy, eval_steps, eval_delay, step, evaluates", [
    ("steps", 5, 0, 7, True),
    (IntervalStrategy.STEPS, 5, 0, 7, True),   # the enum, as HF's TrainingArguments hold it
    ("steps", 5, 0, 10, False),                # HF's own flow callback evaluates at a multiple
    ("steps", 5, 7, 7, True),                  # the delay reached at this step
    ("steps", 5, 8, 7, False),                 # still within the delay
    ("steps", 0, 0, 7, False),
    ("epoch", 5, 0, 7, False),
    ("no", 5, 0, 7, False),
])
def test_the_last_step_stops_and_evaluates_as_hf_would(eval_strategy, eval_steps, eval_delay, step, evaluates):
    state, control = TrainerState(global_step=step, max_steps=100, eval_steps=eval_steps), TrainerControl()
    args = SimpleNamespace(eval_strategy=eval_strategy, eval_delay=eval_delay, save_strategy="no")
    ODBCallback._last_step(args, state, control)
    assert control.should_training_stop and state.max_steps == step
    assert control.should_evaluate is evaluates and not control.should_save


@pytest.mark.parametrize("save_strategy, saves", [("steps", True), (IntervalStrategy.STEPS, True),
                                                  ("epoch", False), ("no", False)])
def test_the_last_step_saves_when_saving_by_steps(save_strategy, saves):
    state, control = TrainerState(global_step=7, max_steps=100, eval_steps=5), TrainerControl()
    ODBCallback._last_step(SimpleNamespace(save_strategy=save_strategy), state, control)
    assert control.should_save is saves and not control.should_evaluate  # no eval_strategy: none


# ---- the audit ledger -------------------------------------------------------------------

def test_a_ledger_line_sums_its_micro_steps():
    steps = [_batch([3, 5, 8], 40, 48, vision_patches=16, audio_frames=4),
             _batch([9], 7, 7, vision_patches=1, audio_frames=0),
             _batch([], 0, 6, idle=True)]
    before = time.time()
    line = step_record(12, 2, steps, row_of=lambda i: 100 + i)
    assert before <= line.pop("wall_time") <= time.time()
    assert line == {"step": 12, "epoch": 2, "indices": [103, 105, 108, 109], "input_tokens": 47,
                    "padded_tokens": 61, "attention_cost": 48 * 48 / 3 + 7 * 7 / 1, "vision_patches": 17,
                    "audio_frames": 4, "micro_steps": 3, "idle_micro_steps": 1}


def test_a_ledger_reopened_after_a_step_keeps_the_lines_up_to_it(tmp_path):
    audit = tmp_path / "runs" / "audit"   # made, parents and all
    ledger = AuditLedger(str(audit), rank=1)
    ledger.open()
    for step in range(1, 6):
        ledger.append({"step": step})
    assert ledger.path == audit / "rank1.jsonl"
    AuditLedger(str(audit), rank=1).open(after_step=3)    # a resume from checkpoint-3
    assert [json.loads(line)["step"] for line in ledger.path.read_text().splitlines()] == [1, 2, 3]
    AuditLedger(str(audit), rank=1).open()                # a new run into the same dir
    assert ledger.path.read_text() == ""


def test_ledgers_are_read_in_rank_order_and_cut_at_a_step(tmp_path):
    for rank in (10, 2, 0, 1):   # rank10 sorts before rank2 as text
        ledger = AuditLedger(str(tmp_path), rank)
        ledger.open()
        ledger.append({"step": 1, "of": rank})
        ledger.append({"step": 2, "of": rank})
    ranks = [lines[0]["of"] for lines in read_rank_ledgers(str(tmp_path))]
    assert ranks == [0, 1, 2, 10]
    assert read_ledger(str(tmp_path), max_step=1) == [{"step": 1, "of": r, "rank": i}
                                                      for i, r in enumerate(ranks)]
    assert len(read_ledger(str(tmp_path))) == 8
    with pytest.raises(FileNotFoundError, match=r"^no rank\*\.jsonl ledger in .*empty$"):
        read_rank_ledgers(str(tmp_path / "empty"))
