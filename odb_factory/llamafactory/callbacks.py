"""Trainer callback: schedule by samples, true epoch progress, per-rank ODB state in every
checkpoint, the audit ledger and ODB metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from transformers import TrainerCallback

from .audit_ledger import AuditLedger, step_record
from .encoder_metrics import EncoderStageMetrics

STATE_FILE = "odb_state_rank{rank}.json"


def _strategy(value: Any) -> str:
    """An IntervalStrategy/SaveStrategy (or its string) as its value: "steps", "epoch", "no"."""
    return str(getattr(value, "value", value))


def state_path(checkpoint_dir: str, rank: int) -> Path:
    return Path(checkpoint_dir) / STATE_FILE.format(rank=rank)


class ODBCallback(TrainerCallback):
    def __init__(self, train_loader_of: Callable[[], Any], progress: Any, rank: int, audit_dir: Optional[str],
                 row_of: Callable[[int], int], max_steps_from_user: bool, num_train_epochs: float,
                 progress_bar_of: Callable[[], Any] = lambda: None):
        self.train_loader_of = train_loader_of
        self.progress_bar_of = progress_bar_of   # HF's training progress bar (None: not shown here)
        self.progress = progress   # the run's SampleProgress (ODBRun.progress)
        self.rank = rank
        self.ledger = AuditLedger(audit_dir, rank) if audit_dir else None
        self.row_of = row_of
        self.max_steps_from_user = max_steps_from_user
        self.num_train_epochs = num_train_epochs
        self.window: Dict[str, float] = {}
        self.encoder_stages = EncoderStageMetrics()
        self.resume_from: Optional[str] = None   # set by the trainer's train()

    def on_train_begin(self, args, trainer_state, control, **kwargs):
        if self.resume_from is not None:
            self._restore(self.resume_from, trainer_state.global_step)
        if self.ledger is not None:
            self.ledger.open(after_step=trainer_state.global_step if self.resume_from is not None else 0)

    def _restore(self, checkpoint: str, global_step: int) -> None:
        path = state_path(checkpoint, self.rank)
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by an ODB run with the same "
                "world size, so ODB cannot resume its data position")
        self.train_loader_of().load_state_dict(json.loads(path.read_text()), global_step)

    def on_step_end(self, args, trainer_state, control, **kwargs):
        loader = self.train_loader_of()
        steps = loader.take_pending()
        self._record(trainer_state, loader, steps)
        epoch = loader.loader.epoch
        trainer_state.epoch = epoch + min(1.0, loader.epoch_consumed / max(1, loader.epoch_samples))
        if not self.max_steps_from_user:
            # Keep HF's step bound ahead of the real count until the data says stop, and
            # let the estimate follow the samples actually consumed.
            bound_reached = trainer_state.global_step >= trainer_state.max_steps
            done = self.progress.fraction
            estimate = round(trainer_state.global_step / done) if done > 0 else trainer_state.max_steps
            trainer_state.max_steps = max(estimate, trainer_state.global_step + 2)
            if trainer_state.epoch >= self.num_train_epochs - 1e-9:
                self._last_step(args, trainer_state, control)
            elif bound_reached:
                # HF stopped at its step estimate, which ODB's variable batches overrun; a stop
                # asked for by another callback (LLaMA-Board's abort, a user's) is kept
                control.should_training_stop = False
            self._show_total(trainer_state.max_steps)
        return control

    def _show_total(self, steps: int) -> None:
        """HF's progress bar took its total from the first step estimate; it follows the
        estimate, and ends at the real count."""
        bar = self.progress_bar_of()
        if bar is not None and bar.total != steps:
            bar.total = steps
            bar.refresh()

    @staticmethod
    def _last_step(args, trainer_state, control) -> None:
        """The data ran out: this is the run's last optimizer step. HF's flow callback, which
        had only the step estimate, did not know; do what it does at a last step: stop, and
        evaluate and save when the strategy is by steps."""
        control.should_training_stop = True
        trainer_state.max_steps = trainer_state.global_step
        step = trainer_state.global_step
        if (_strategy(getattr(args, "eval_strategy", None)) == "steps" and trainer_state.eval_steps
                and step % trainer_state.eval_steps != 0 and getattr(args, "eval_delay", 0) <= step):
            control.should_evaluate = True
        if _strategy(getattr(args, "save_strategy", None)) == "steps":
            control.should_save = True

    def on_train_end(self, args, trainer_state, control, **kwargs):
        if not self.max_steps_from_user:
            trainer_state.max_steps = trainer_state.global_step

    def on_save(self, args, trainer_state, control, **kwargs):
        loader = self.train_loader_of()
        checkpoint = Path(args.output_dir) / f"checkpoint-{trainer_state.global_step}"
        if checkpoint.is_dir():
            state_path(str(checkpoint), self.rank).write_text(json.dumps(loader.state_dict()))

    def _record(self, trainer_state, loader, steps: List[Any]) -> None:
        for step in steps:
            for key, value in step.metrics.items():
                self.window[key] = self.window.get(key, 0.0) + value
            if "balance_max_over_lb" in step.metrics:
                self.window["rounds_seen"] = self.window.get("rounds_seen", 0.0) + 1
        self.window["micro_steps"] = self.window.get("micro_steps", 0.0) + len(steps)
        self.window["audio_frames"] = self.window.get("audio_frames", 0.0) + sum(s.audio_frames for s in steps)
        self.window["optimizer_steps"] = self.window.get("optimizer_steps", 0.0) + 1
        self.window["global_samples"] = (self.window.get("global_samples", 0.0)
                                         + sum(s.global_num_samples for s in steps))
        if self.ledger is not None:
            self.ledger.append(step_record(trainer_state.global_step, loader.loader.epoch, steps, self.row_of))

    def pop_log_metrics(self) -> Dict[str, float]:
        """ODB figures since the last log line, for the trainer's logs (and TensorBoard)."""
        w, self.window = self.window, {}
        micro = w.get("micro_steps", 0.0)
        if not micro:
            return {}
        padded = w.get("padded_tokens", 0.0)
        balance = {f"odb/{k}": round(w[k] / max(1.0, w.get("rounds_seen", 0.0)), 4)
                   for k in ("balance_max_over_lb_before", "balance_max_over_lb") if k in w}
        balance.update({f"odb/{k}": w[k] for k in ("balance_bytes_intra_node", "balance_bytes_inter_node",
                                                   "global_grouping_rounds") if k in w})
        if w.get("audio_frames"):  # valid mel frames this rank's loader placed, per micro-step
            balance["odb/audio_frames_per_step"] = round(w["audio_frames"] / micro, 1)
        return {
            **balance,
            **self.encoder_stages.pop(),
            "odb/padding_efficiency": round(w.get("input_tokens", 0.0) / padded, 4) if padded else 0.0,
            "odb/tokens_per_step": round(w.get("input_tokens", 0.0) / micro, 1),
            "odb/samples_per_step": round(w.get("samples", 0.0) / micro, 2),
            "odb/micro_steps_per_optimizer_step": round(micro / max(1.0, w.get("optimizer_steps", 0.0)), 2),
            "odb/samples_per_optimizer_step": round(w.get("global_samples", 0.0)
                                                    / max(1.0, w.get("optimizer_steps", 0.0)), 2),
            "odb/splits": w.get("splits", 0.0),
            "odb/overflow_groups": w.get("overflow_groups", 0.0),
            "odb/over_budget_samples": w.get("over_budget", 0.0),  # trained alone, over the budget
            "odb/idle_steps": w.get("idle", 0.0),
            "odb/data_wait_s": round(w.get("data_wait_s", 0.0), 4),
        }
