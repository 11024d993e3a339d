"""ODBDataLoader: the public loader that yields aligned, token-budgeted steps.

Pipeline per rank (docs/dgap.md has the protocol):
  sample workers (dataset pipeline + cost; chunks of samples, each packed as bytes)
    -> planner thread (window, grouping, alignment over the Gloo side channel)
    -> collation workers (user collate_fn, one group each, in parallel)
    -> training loop (ODBBatch with exact loss scale)
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from torch.utils.data import DataLoader

from ..config import ODBConfig, option_name
from ..cost import CostFn, DefaultCost
from ..planning.grouping import Budget
from ..planning.optimizer_steps import MICRO_MEAN, TOKEN_MEAN, StandardStep, fixed_batch_steps
from ..balance.step_plan import step_balance_of
from ..planning.rounds import RankPlanner
from ..planning.views import cycling_view, epoch_view
from .step_rebalancer import StepRebalancer
from .batch import ODBBatch
from .collate_stage import CollateJob, PlanSampler
from .sample_stage import (CostedDataset, PackedChunks, ViewSampler, chunk_size, identity,
                           in_thread_samples, named_worker_deaths, worker_samples)
from .metrics import LoaderMetrics
from .planner_thread import EpochPlanner, OptimizerStepSpec, PlannerThread, SampleStore, StepPlan
from ..comm.channel import SyncChannel
from ..comm.errors import ODBSyncError

# the layout of state_dict(); load_state_dict() refuses any other
STATE_VERSION = 1


def die_with_parent(_worker_id: int) -> None:
    """DataLoader worker_init_fn: the worker is killed when the rank process that started it
    dies. torch's own check of the parent runs only between fetches, so a worker blocked on a
    full pipe to a SIGKILLed rank would otherwise live on (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    PR_SET_PDEATHSIG = 1
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def start_workers(loaders: List[DataLoader]) -> None:
    """Start the persistent workers now, before any planner thread exists, so later epochs
    never fork a multi-threaded process.

    torch installs a SIGCHLD handler with its first worker processes, which raises a dead
    worker's error in the main thread wherever it happens to be (inside the user's step,
    where nobody can tell the peers). The loader notices dead workers itself where it waits
    on them, names them and tells the peers, so the handler this call installed is undone
    (torch's own status check still sees a dead worker within 5 s)."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGCHLD) if in_main else None
    for loader in loaders:
        for _ in loader:
            pass
    if in_main and previous is not None and signal.getsignal(signal.SIGCHLD) is not previous:
        signal.signal(signal.SIGCHLD, previous)


class ODBDataLoader:
    """Token-budgeted, DDP-aligned batches formed after the dataset's own pipeline.

    Example::

        cfg = ODBConfig(token_budget=4096, join=True, loss_scaling="exact", seed=0)
        loader = ODBDataLoader(dataset, cfg, collate_fn=my_collate, num_workers=2)
        for epoch in range(3):
            loader.set_epoch(epoch)
            for step in loader:
                loss = token_mean_loss(model(**step.data)) * step.loss_scale
                loss.backward(); optimizer.step(); optimizer.zero_grad()

    Inside an initialised process group the loader takes rank and world size from it and
    creates its own Gloo group for alignment (construct loaders in the same order on every
    rank). Every rank yields the same number of steps per epoch.
    """

    def __init__(self, dataset: Any, config: Optional[ODBConfig] = None, *,
                 collate_fn: Callable[[List[Any]], Any] = identity,
                 cost_fn: Optional[CostFn] = None, num_workers: Optional[int] = None,
                 num_collate_workers: Optional[int] = None,
                 standard_steps: Optional[Callable[[int], Sequence[StandardStep]]] = None):
        """standard_steps(epoch): step_mode="samples" only, this rank's optimizer steps of the
        fixed-batch run to reproduce (default: `fixed_batch_steps` with the config's
        standard_batch_size and gradient_accumulation_steps)."""
        self.config = config = config or ODBConfig()
        if num_workers is not None:
            config.num_workers = num_workers
        if num_collate_workers is not None:
            config.num_collate_workers = num_collate_workers
        config.validate()
        if config.loss_scaling == "standard":
            raise ValueError("ODBConfig.loss_scaling 'standard' is resolved by the LLaMA-Factory trainer; "
                             "with the engine choose 'exact' or (step_mode 'samples') 'micro_mean'")
        try:
            self.num_samples = len(dataset)
        except TypeError:
            raise TypeError("ODBDataLoader needs a map-style dataset with __len__ "
                            f"(got {type(dataset).__name__})") from None
        self.sync = SyncChannel.create(config.sync_timeout_s)
        self.rank, self.world_size = self.sync.rank, self.sync.world_size
        if self.num_samples < self.world_size:
            raise ValueError(f"the dataset has {self.num_samples} samples, fewer than the "
                             f"{self.world_size} ranks: every rank needs at least one")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self._costed = CostedDataset(dataset, cost_fn or DefaultCost.from_config(config))
        self._standard_steps = standard_steps or self._fixed_batch_steps
        self._optimizer_steps: Dict[int, int] = {}     # samples mode: epoch -> steps completed
        self._micro_in_step: Dict[int, int] = {}       # samples mode: epoch -> micro-steps since the last
        self._replay = 0                               # resumed: micro-steps to plan again, not yield
        self._epoch = 0
        self._consumed: Dict[int, List[int]] = {}      # epoch -> indices trained on this rank
        self._consumed_global: Dict[int, int] = {}     # epoch -> samples trained by all ranks
        self._resume: Optional[dict] = None
        self._checked = False
        self._last_epoch_end: Optional[tuple] = None   # (epoch, last step) of the last iteration
        self._active: Optional[Iterator[ODBBatch]] = None
        self.metrics = LoaderMetrics()
        self._view_sampler = ViewSampler(chunk_size(config.buffer_size, config.num_workers))
        self._plan_sampler = PlanSampler()
        self._sample_loader = self._make_loader(PackedChunks(self._costed), self._view_sampler,
                                                config.num_workers)
        self._collate_loader = self._make_loader(CollateJob(collate_fn), self._plan_sampler,
                                                 config.num_collate_workers)
        start_workers([loader for loader in (self._sample_loader, self._collate_loader)
                       if loader is not None])

    def _make_loader(self, dataset, sampler, workers: int) -> Optional[DataLoader]:
        if workers == 0:
            return None  # the stage runs in this process: pipeline in the planner thread,
                         # collation in the training thread
        return DataLoader(dataset, batch_size=None, sampler=sampler, collate_fn=identity,
                          num_workers=workers, persistent_workers=True, worker_init_fn=die_with_parent,
                          prefetch_factor=self.config.prefetch_factor,
                          multiprocessing_context=self.config.multiprocessing_context)

    # ---------------------------------------------------------------- epochs and state
    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict:
        """This rank's resumable state (no collective). Save it per rank. Right after
        load_state_dict() it is the restored state, until the loader moves (an iteration,
        or set_epoch() to another epoch, which then starts afresh)."""
        if self._resume is not None and self._resume["epoch"] == self._epoch:
            return dict(self._resume)
        return {"version": STATE_VERSION, "epoch": self._epoch, "rank": self.rank, "world_size": self.world_size,
                "consumed": sorted(self._consumed.get(self._epoch, [])),
                "consumed_global": self._consumed_global.get(self._epoch, 0),
                "steps": self.metrics.epoch_steps.get(self._epoch, 0),
                "optimizer_steps": self._optimizer_steps.get(self._epoch, 0),
                "micro_steps_in_step": self._micro_in_step.get(self._epoch, 0),
                "config": self.config.planning_fields()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by state_dict() on this rank; the next iteration of that
        epoch continues the saved run from the micro-step the state was saved after, with the
        same steps the uninterrupted run has (`_restore_epoch`). Resuming with another world
        size is not supported."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"ODB state of version {state.get('version')!r}: this odb-factory reads version "
                             f"{STATE_VERSION} (ODBDataLoader.state_dict); resume with the release that saved it")
        if state.get("world_size") != self.world_size:
            raise ValueError(f"ODB state was saved with world size {state.get('world_size')}, "
                             f"this run has {self.world_size}")
        if state.get("rank") != self.rank:
            raise ValueError(f"ODB state of rank {state.get('rank')} given to rank {self.rank}: each rank "
                             "resumes from the state it saved (save one per rank, load it on the same rank)")
        changed = [f"{option_name(k)} is {v!r} now, {state['config'].get(k)!r} in the state"
                   for k, v in self.config.planning_fields().items() if state["config"].get(k) != v]
        if changed:
            raise ValueError("ODB state was saved with different planning options: " + "; ".join(changed)
                             + ". Resume with the options it was saved with")
        self._epoch = state["epoch"]
        self._resume = state

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[ODBBatch]:
        if self._active is not None:
            self._active.close()
        self._active = self._iterate(self._epoch)
        return self._active

    def _check_ranks_agree(self) -> None:
        mine = dict(self.config.planning_fields(), dataset_length=self.num_samples)
        every = self.sync.all_gather(mine, "config check")
        for rank, theirs in enumerate(every):
            for key, value in mine.items():
                if theirs[key] != value:
                    raise ValueError(
                        f"ODB option '{key}' differs between rank {self.rank} ({value!r}) and "
                        f"rank {rank} ({theirs[key]!r}); every rank must use the same ODBConfig "
                        "planning options and the same dataset")
        self._checked = True

    def _check_epoch_start(self, epoch: int) -> None:
        """Every rank starts the same epoch, having left the previous one at the same step.
        Ranks that broke out at different steps get one error naming both sides, here,
        instead of a shifted pairing of exchanges."""
        mine = self._last_epoch_end
        every = self.sync.all_gather(mine, "epoch start", epoch)
        for rank, theirs in enumerate(every):
            if theirs != mine:
                def ended(end):
                    return "no earlier iteration" if end is None else f"epoch {end[0]} after step {end[1]}"
                raise ODBSyncError(
                    f"ODB ranks left the previous epoch at different points: rank {self.rank} left "
                    f"{ended(mine)}, rank {rank} left {ended(theirs)}. Every rank must iterate each "
                    "epoch to the same step (break on all ranks at the same step, or let it end)")

    def _restore_epoch(self, epoch: int) -> None:
        """Where the epoch's planning starts. Without a restored state the epoch starts
        afresh, step count included.

        A restored state continues the saved run exactly: its micro-steps are planned again,
        with the same exchanges on every rank, but not collated or yielded (`self._replay`).
        Groups mode replays the epoch from its start (a group depends on the window before it);
        samples mode plans from the first untrained Standard step and replays the micro-steps of
        that step already trained. Only the input pipeline runs again over the trained samples."""
        state, self._resume = self._resume, None
        self._micro_in_step[epoch] = self._replay = 0
        if state is None or state["epoch"] != epoch:
            self._consumed[epoch] = []
            self._consumed_global[epoch] = 0
            self.metrics.epoch_steps[epoch] = 0
            self._optimizer_steps[epoch] = 0
            return
        self._consumed[epoch] = list(state["consumed"])
        self._consumed_global[epoch] = state["consumed_global"]
        self._optimizer_steps[epoch] = state.get("optimizer_steps", 0)
        if self.config.step_mode == "samples":
            self._replay = state.get("micro_steps_in_step", 0)
        else:
            self._replay = state["steps"]
        self.metrics.epoch_steps[epoch] = state["steps"] - self._replay

    def _iterate(self, epoch: int) -> Iterator[ODBBatch]:
        cfg = self.config
        if not self._checked:
            self._check_ranks_agree()
        self._check_epoch_start(epoch)
        self._restore_epoch(epoch)
        view = epoch_view(self.num_samples, self.world_size, self.rank, cfg.seed, epoch, cfg.shuffle)
        quota, optimizer_steps = None, None
        if cfg.step_mode == "samples":
            optimizer_steps = self._optimizer_step_spec(epoch)
            order = [i for step in optimizer_steps.steps for i in step.indices]
        elif not cfg.join:
            quota = cfg.quota or self.num_samples
            # the view, then repeats of it: a quota above the dataset size still closes
            order = cycling_view(view, cfg.seed, epoch, self.rank)
        else:
            order = view
        if self._sample_loader is None:
            samples = in_thread_samples(self._costed, order, packed=cfg.num_collate_workers > 0)
        else:
            self._view_sampler.order = order
            samples = worker_samples(self._sample_loader, self.rank)
        store = SampleStore(samples)
        planner = None if optimizer_steps is not None else RankPlanner(
            Budget.from_config(cfg), cfg.buffer_size, store.stream(), rank=self.rank,
            over_budget=cfg.over_budget, quota=quota, shuffle_seed=f"{cfg.seed}:{epoch}")
        first = view[0]  # (every rank has samples: __init__ refuses fewer samples than ranks)
        epoch_planner = EpochPlanner(planner, store, self.sync, epoch, cfg.gradient_accumulation_steps,
                                     filler=lambda: self.dataset[first],
                                     step_offset=self.metrics.epoch_steps.get(epoch, 0),
                                     pad_to_window=cfg.pad_epoch_to_accumulation,
                                     rebalancer=self._rebalancer(), optimizer_steps=optimizer_steps,
                                     replay=self._replay)
        thread = None
        if self._sample_loader is None and self._collate_loader is None:
            # no workers at all: plan in this thread, as torch loads with num_workers=0
            job = CollateJob(self.collate_fn)
            steps = (job[plan] for plan in epoch_planner.inline_plans())
        else:
            plans: "queue.Queue" = queue.Queue(maxsize=cfg.outstanding_depth)
            thread = PlannerThread(epoch_planner, plans)
            thread.start()
            self._plan_sampler.attach(plans, thread)
            if self._collate_loader is None:
                job = CollateJob(self.collate_fn)
                steps = (job[plan] for plan in self._plan_sampler)
            else:
                steps = named_worker_deaths(self._collate_loader, "collate", self.rank)
        last_step = -1
        try:
            while True:
                start = time.perf_counter()
                try:
                    plan, data = next(steps)
                except StopIteration:
                    break
                except BaseException as exc:  # this rank's collation or planning failed
                    epoch_planner.leave(last_step, failure=exc)
                    raise
                error = epoch_planner.error_before(plan.step)
                if error is not None:  # a failure here or on a peer jumps the queue
                    epoch_planner.leave(last_step)
                    raise error
                last_step = plan.step
                if plan.replayed:  # trained before the state was saved
                    self.metrics.epoch_steps[epoch] += 1
                    if cfg.step_mode == "samples":
                        self._micro_in_step[epoch] += 1
                    continue
                yield self._to_batch(plan, data, time.perf_counter() - start)
        finally:
            self._last_epoch_end = (epoch, last_step)
            epoch_planner.leave(last_step)
            if thread is not None:
                thread.join(timeout=cfg.sync_timeout_s)
                self._plan_sampler.detach()
                if thread.is_alive():
                    # never start another epoch beside a planner still inside this one's exchanges
                    raise ODBSyncError(
                        f"ODB planner of rank {self.rank}, epoch {epoch}, did not stop within "
                        f"{cfg.sync_timeout_s:.0f}s (ODBConfig.sync_timeout_s) after the trainer left "
                        "the epoch: a peer is neither continuing nor leaving; see the other ranks' logs")

    def _fixed_batch_steps(self, epoch: int) -> List[StandardStep]:
        cfg = self.config
        return fixed_batch_steps(self.num_samples, self.world_size, self.rank, cfg.standard_batch_size,
                                 cfg.gradient_accumulation_steps, cfg.seed, epoch, cfg.shuffle)

    def _optimizer_step_spec(self, epoch: int) -> OptimizerStepSpec:
        """Samples mode: the epoch's Standard steps not trained yet, and how to pack them."""
        cfg, done = self.config, self._optimizer_steps[epoch]   # set at the epoch's start
        steps = list(self._standard_steps(epoch))
        for step in steps:
            bad = [i for i in step.indices if not 0 <= i < self.num_samples]
            if bad:
                raise ValueError(f"standard_steps({epoch}) names indices {bad[:5]} outside the dataset "
                                 f"of {self.num_samples} samples")
        normalization = MICRO_MEAN if cfg.loss_scaling == "micro_mean" else TOKEN_MEAN
        return OptimizerStepSpec(steps[done:], Budget.from_config(cfg), cfg.over_budget, normalization,
                                 first_step=done)

    def _rebalancer(self) -> Optional[StepRebalancer]:
        cfg = self.config
        if not (cfg.balance or cfg.global_grouping) or self.world_size == 1:
            return None
        spec = step_balance_of(cfg, self.world_size)
        return StepRebalancer(self.sync, spec if cfg.balance else None, Budget.from_config(cfg),
                              global_grouping=cfg.global_grouping, seed=str(cfg.seed),
                              ranks_per_node=spec.ranks_per_node)

    def _to_batch(self, plan: StepPlan, data: Any, wait_s: float) -> ODBBatch:
        cfg = self.config
        if plan.is_idle or plan.global_label_tokens == 0:
            scale = 0.0
        elif cfg.loss_scaling == "exact":
            scale = self.world_size * plan.label_tokens / plan.global_label_tokens
        else:
            scale = 1.0
        metrics = self.metrics.record(plan, wait_s)
        if plan.step_end:
            self._optimizer_steps[plan.epoch] += 1
        if self.config.step_mode == "samples":  # (groups mode plans on from what was trained)
            self._micro_in_step[plan.epoch] = 0 if plan.step_end else self._micro_in_step.get(plan.epoch, 0) + 1
        self._consumed.setdefault(plan.epoch, []).extend(plan.indices)
        self._consumed_global[plan.epoch] = self._consumed_global.get(plan.epoch, 0) + plan.global_num_samples
        return ODBBatch(data=data, indices=list(plan.indices), label_tokens=plan.label_tokens,
                        global_label_tokens=plan.global_label_tokens, loss_scale=scale,
                        is_idle=plan.is_idle, epoch=plan.epoch, step=plan.step,
                        input_tokens=plan.input_tokens, padded_tokens=plan.padded_tokens,
                        vision_patches=plan.vision_patches, audio_frames=plan.audio_frames,
                        global_num_samples=plan.global_num_samples, metrics=metrics,
                        sample_weights=list(plan.sample_weights), optimizer_step_end=plan.step_end)

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the current epoch (if any) and shut down all worker processes.

        torch has no public way to stop a persistent-workers DataLoader: this uses its
        `_iterator` and that iterator's `_shutdown_workers()` (docs/upstream_contract.md), and
        raises, naming the torch version, if either is missing rather than leave workers running."""
        if self._active is not None:
            self._active.close()
            self._active = None
        for loader in (self._sample_loader, self._collate_loader):
            if loader is None:
                continue
            if not hasattr(loader, "_iterator"):
                missing = "DataLoader._iterator"
            elif loader._iterator is None:
                continue  # no workers were started
            elif not hasattr(loader._iterator, "_shutdown_workers"):
                missing = f"{type(loader._iterator).__name__}._shutdown_workers"
            else:
                loader._iterator._shutdown_workers()
                loader._iterator = None
                continue
            import torch
            raise RuntimeError(
                f"ODBDataLoader.close() cannot stop its DataLoader worker processes: torch "
                f"{torch.__version__} has no {missing} (odb-factory relies on it; written for "
                f"torch 2.14.1, see docs/upstream_contract.md)")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
