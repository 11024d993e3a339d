"""Stateful property test of the real threaded loader at world size 1.

Hypothesis drives one ODBDataLoader (planner thread + channel, in this process) through
random sequences of: iterate some steps and break, iterate to the end, re-iterate the epoch,
move to the next epoch, save state_dict(), restore it (into the same or a fresh loader), and
reopen with other accumulation / post-balancing options. A plain model kept here predicts
what the loader must report; label tokens are recounted from the dataset's lengths.
"""

from __future__ import annotations

import copy
import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

PROMPT_FRACTION = 0.3


def supervised_tokens(length: int) -> int:
    """LengthDataset masks the first int(0.3 * length) labels; a shifted loss never sees label 0."""
    return length - max(int(length * PROMPT_FRACTION), 1)


class LoaderMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loader = None
        self.saved = None      # (options, state_dict) of the last save
        self.pending = None    # a loaded state the next iteration must resume from

    # ------------------------------------------------------------------ set-up
    @initialize(n=st.integers(3, 24), seed=st.integers(0, 3), join=st.booleans(),
                quota_factor=st.sampled_from([None, 0.5, 1.0, 1.7]), budget=st.sampled_from([40, 96]),
                buffer=st.integers(2, 8), accumulation=st.integers(1, 3), pad=st.booleans(),
                balance=st.booleans())
    def start(self, n, seed, join, quota_factor, budget, buffer, accumulation, pad, balance):
        self.lengths = long_tail_lengths(n, cv=1.0, mean=14, seed=seed, minimum=1, maximum=60)
        self.dataset = LengthDataset(self.lengths, prompt_fraction=PROMPT_FRACTION, seed=seed)
        quota = None if join or quota_factor is None else max(1, int(quota_factor * n))
        self.base = dict(token_budget=budget, buffer_size=buffer, join=join, quota=quota, seed=seed,
                         outstanding_depth=2)
        self._open(dict(self.base, gradient_accumulation_steps=accumulation,
                        pad_epoch_to_accumulation=pad, balance=balance))

    def _open(self, options):
        if self.loader is not None:
            self.loader.close()
        self.options = options
        self.loader = ODBDataLoader(self.dataset, ODBConfig(**options), collate_fn=pad_collate)
        self.epoch, self.trained, self.steps, self.pending = 0, [], 0, None

    def teardown(self):
        if self.loader is not None:
            self.loader.close()
        alive = [t for t in threading.enumerate() if t.name.startswith("odb-planner") and t.is_alive()]
        assert not alive, f"planner threads left running after close(): {alive}"

    # ------------------------------------------------------------------ rules
    @rule(limit=st.one_of(st.none(), st.integers(1, 7)))
    def iterate(self, limit):
        if self.pending is not None and self.pending["epoch"] == self.epoch:
            self.trained, self.steps = list(self.pending["consumed"]), self.pending["steps"]
        else:
            self.trained, self.steps = [], 0
        self.pending = None
        seen = []
        for step in self.loader:
            seen.append(step)
            if limit is not None and len(seen) == limit:
                break
        completed = limit is None or len(seen) < limit
        k = self.options["gradient_accumulation_steps"]
        # steps count on from where this epoch was (0, or the restored count)
        assert [s.step for s in seen] == list(range(self.steps, self.steps + len(seen)))
        new = []
        for s in seen:
            assert s.epoch == self.epoch
            assert s.is_idle == (s.indices == [])
            assert s.label_tokens == sum(supervised_tokens(self.lengths[i]) for i in s.indices)
            if not s.is_idle:
                assert s.data["index"].tolist() == s.indices
            new += s.indices
        if self.options["join"]:
            assert not set(new) & set(self.trained), "an index trained twice in one epoch"
            assert len(set(new)) == len(new)
        # loss scales: each emitted window's denominator is its label tokens (world 1)
        windows = [seen[a:a + k] for a in range(0, len(seen), k)]
        for w, window in enumerate(windows):
            total = sum(s.label_tokens for s in window)
            assert len({s.global_label_tokens for s in window}) == 1
            whole = len(window) == k or (completed and w == len(windows) - 1)
            if whole:
                assert window[0].global_label_tokens == total
            else:  # we broke off inside this window
                assert window[0].global_label_tokens >= total
            for s in window:
                expected = 0.0 if s.is_idle or not s.global_label_tokens else s.label_tokens / s.global_label_tokens
                assert s.loss_scale == expected
            if whole and total:
                assert abs(sum(s.loss_scale for s in window) - 1.0) <= 1e-12
        self.trained += new
        self.steps += len(seen)
        if completed:
            if self.options["join"]:
                assert sorted(self.trained) == list(range(len(self.lengths)))
            else:
                assert len(self.trained) == (self.options["quota"] or len(self.lengths))
            if self.options["pad_epoch_to_accumulation"]:
                assert len(seen) % k == 0

    @precondition(lambda self: self.pending is None)
    @rule()
    def next_epoch(self):
        # (not while a loaded state is pending: state_dict() keeps returning that state)
        self.epoch += 1
        self.loader.set_epoch(self.epoch)
        self.trained, self.steps = [], 0

    @rule()
    def save(self):
        state = self.loader.state_dict()
        assert state["world_size"] == 1 and state["rank"] == 0
        assert state["config"] == ODBConfig(**self.options).planning_fields()
        self.saved = (dict(self.options), copy.deepcopy(state))

    @precondition(lambda self: self.saved is not None)
    @rule(fresh=st.booleans())
    def restore(self, fresh):
        options, state = self.saved
        if fresh or options != self.options:
            self._open(options)
        self.loader.load_state_dict(copy.deepcopy(state))
        assert self.loader.state_dict() == state
        self.epoch, self.pending = state["epoch"], state

    @rule(accumulation=st.integers(1, 3), pad=st.booleans(), balance=st.booleans())
    def reopen_with(self, accumulation, pad, balance):
        self._open(dict(self.base, gradient_accumulation_steps=accumulation,
                        pad_epoch_to_accumulation=pad, balance=balance))
        if self.saved is not None and self.saved[0] != self.options:
            before = self.loader.state_dict()
            try:
                self.loader.load_state_dict(copy.deepcopy(self.saved[1]))
            except ValueError as exc:
                assert "different planning options" in str(exc)
            else:
                raise AssertionError("a state saved under other planning options was accepted")
            assert self.loader.state_dict() == before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def state_dict_matches_the_model(self):
        if self.loader is None:
            return
        state = self.loader.state_dict()
        if self.pending is not None:
            assert state == self.pending
            return
        assert state["epoch"] == self.epoch == self.loader.epoch
        assert state["consumed"] == sorted(self.trained)
        assert state["consumed_global"] == len(self.trained)
        assert state["steps"] == self.steps


LoaderMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)
test_loader_state_machine = LoaderMachine.TestCase
