"""Several LLaMA-Factory runs in one torchrun, one after another (bench.measured_runs).

    torchrun --nproc_per_node 2 bench/lf_multi_run.py RUNS.json

RUNS.json: a list of LLaMA-Factory configs (dicts). Each goes through `run_exp(config)`, the
function `llamafactory-cli train` ends in, in the same processes: the ~13 s of imports per
process on a 2-core machine are paid once, not per run. The process group is kept between runs
(LLaMA-Factory destroys it at the end of each run; a re-created default group can deadlock the
next rendezvous), so the runs share it as they share the processes.

A config value `{"mean_group_size_of": AUDIT_DIR}` is replaced, once the earlier runs are done on
every rank, by ODB's mean samples per micro-step in that run's ledger (bench.measured_runs sizes
its matched fixed batch from a calibration run so).

A config with `"peer_integration": true` is the peer package's attempt: online-dynamic-batching
0.1.2's own LLaMA-Factory adapter (`odb.integrations.llamafactory.enable_odb`) is called on
LLaMA-Factory's trainer as it is built, with the trainer's own train DataLoader; an exception
(raised on every rank before any collective) is written to `<output_dir>/error.txt` and the
next run goes on.

Per run, each rank writes `<output_dir>/compute_rank<r>.json`: the seconds spent inside the
trainer's `training_step` (forward + backward of every micro-batch of an optimizer step), the
share of train time that is compute; and `steps_rank<r>.jsonl`: per `training_step` call, its
seconds and the work of its micro-batches in the step model's terms (micro-batches, padded
tokens, attention Σ len², positions the LM head computes, images, patches, Σ patches²), for
the step model's out-of-sample check.
A config with `"profile": true` runs under torch's profiler and each rank also writes
`<output_dir>/profile_rank<r>.txt`: where the run's CPU time went, operator by operator (self
time), with the trainer's `training_step` as a labelled range (torch labels the optimizer's step).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from odb_factory.loss import supervised_positions


def micro_batch_work(batch, supervised_logits: bool = False) -> dict:
    """One micro-batch in the step model's terms. Padded rows: rows × width tokens and
    rows × width² attention; a padding-free row (no attention mask): each sample's own
    length², read from where the text position ids restart. `logit_tokens`: the positions the
    LM head computes, all of them or (`supervised_logits`, the ODB trainer's
    `odb_supervised_logits`) those whose next token is supervised."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    positions = batch.get("position_ids")
    if batch.get("attention_mask") is None and positions is not None:
        text = positions[0] if positions.dim() == 3 else positions          # (rows, width)
        starts = [i for i, v in enumerate(text[0].tolist()) if v == 0] + [width]
        sum_sq = sum((b - a) ** 2 for a, b in zip(starts, starts[1:]))
    else:
        sum_sq = rows * width ** 2
    grid = batch.get("image_grid_thw")
    per_image = grid.prod(dim=1).tolist() if grid is not None else []
    logit_tokens = rows * (len(supervised_positions(batch["labels"])) if supervised_logits else width)
    return {"micro_batches": 1, "tokens": rows * width, "sum_sq": sum_sq, "logit_tokens": logit_tokens,
            "images": len(per_image), "patches": sum(per_image), "patch_sq": sum(x * x for x in per_image)}


def step_work(inputs, keeps_supervised_logits=lambda batch: False) -> dict:
    """A `training_step` call's work: one micro-batch, or `samples` mode's several
    (`keeps_supervised_logits(batch)`: the ODB trainer's own decision for that micro-batch)."""
    batches = getattr(inputs, "micro_batches", None) or [inputs]
    works = [micro_batch_work(b, keeps_supervised_logits(b)) for b in batches]
    return {k: sum(w[k] for w in works) for k in works[0]}


class ComputeTimer:
    """Seconds inside the outermost `training_step` call (subclasses call their parents'), and
    each such call's work and seconds."""

    def __init__(self):
        self.seconds = 0.0
        self.steps = []
        self._depth = threading.local()

    def wrap(self, cls) -> None:
        inner = cls.training_step

        @functools.wraps(inner)
        def timed(trainer, model, inputs, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                with torch.profiler.record_function("training_step" if depth == 0 else "training_step (inner)"):
                    return inner(trainer, model, inputs, *args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    seconds = time.perf_counter() - start
                    self.seconds += seconds
                    keeps = getattr(trainer, "_odb_keeps_supervised_logits", lambda batch: False)
                    self.steps.append(dict(step_work(inputs, keeps), time_s=seconds))
        cls.training_step = timed


def resolve(config: dict) -> dict:
    """`config` with every `{"mean_group_size_of": AUDIT_DIR}` value read from that ledger."""
    from bench.measured import mean_group_size
    return {k: mean_group_size(Path(v["mean_group_size_of"])) if isinstance(v, dict) and "mean_group_size_of" in v
            else v for k, v in config.items()}


def peer_trainer_patch(budget: int):
    """Builds LLaMA-Factory's trainer, then hands it to the peer package's adapter; returns the
    undo function."""
    import llamafactory.train.sft.trainer as sft
    from odb.integrations.llamafactory import enable_odb

    init = sft.CustomSeq2SeqTrainer.__init__

    def with_peer(trainer, *args, **kwargs):
        init(trainer, *args, **kwargs)
        enable_odb(trainer, train_dataloader=trainer.get_train_dataloader(), token_budget=budget,
                   join=True, loss_scaling="exact")
    sft.CustomSeq2SeqTrainer.__init__ = with_peer
    return lambda: setattr(sft.CustomSeq2SeqTrainer, "__init__", init)


def main(path: str) -> None:
    import torch.distributed as dist
    import transformers
    from llamafactory.train.tuner import run_exp

    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    timer = ComputeTimer()
    timer.wrap(transformers.Trainer)
    timer.wrap(ODBTrainerMixin)
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    rank = int(os.environ.get("RANK", "0"))
    try:
        for config in json.loads(Path(path).read_text()):
            if dist.is_initialized():    # (by the first run) every rank's earlier ledgers are complete
                dist.barrier()
            config = resolve(config)
            timer.seconds, timer.steps = 0.0, []
            out = Path(config["output_dir"])
            profiling = config.pop("profile", False)
            if config.pop("peer_integration", False):
                undo = peer_trainer_patch(int(config.pop("peer_token_budget")))
                try:
                    run_exp(config)
                except Exception as exc:   # the peer's own failure is the finding
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "error.txt").write_text(f"{type(exc).__name__}: {exc}")
                    print(f"[lf_multi_run] rank {rank}: peer integration failed: {exc}", file=sys.stderr, flush=True)
                    continue
                finally:
                    undo()
            else:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiling \
                        else nullcontext() as profile:
                    run_exp(config)
                if profiling:
                    (out / f"profile_rank{rank}.txt").write_text(profile.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
            (out / f"compute_rank{rank}.json").write_text(json.dumps({"training_step_s": timer.seconds}))
            (out / f"steps_rank{rank}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in timer.steps))
            print(f"[lf_multi_run] rank {rank}: {config['output_dir']} done", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group = destroy
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
