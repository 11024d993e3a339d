"""DefaultCost against hand counts and a brute-force recount written here.

The label data deliberately supervises the first label: a causal LM never predicts it, so the
shifted count (the loss denominator) is one less than a plain count, and a count taken before
the shift would show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory import ODBConfig, SampleCost
from odb_factory.cost import FRAMES_PER_AUDIO_TOKEN, DefaultCost, MissingCostKeyError

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def _supervised_after_shift(labels, ignore_index=-100, shift=True):
    """Brute-force oracle: positions the loss averages over, one by one."""
    start = 1 if shift else 0
    return sum(1 for position, label in enumerate(labels) if position >= start and label != ignore_index)


# ------------------------------------------------------------------ LLM and label tokens

def test_hand_counted_labels_with_the_first_label_supervised():
    sample = {"input_ids": [11, 12, 13, 14, 15, 16], "labels": [11, -100, 13, 14, -100, 16]}
    assert DefaultCost()(sample) == SampleCost(6, 3, 0)          # labels[1:]: 13, 14, 16
    assert DefaultCost(label_shift=False)(sample) == SampleCost(6, 4, 0)  # 11 counts too


def test_a_masked_first_label_counts_the_same_either_way():
    sample = {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, -100]}
    assert DefaultCost()(sample).label_tokens == DefaultCost(label_shift=False)(sample).label_tokens == 2


@pytest.mark.parametrize("kind", ["list", "tensor", "numpy", "bfloat16 tensor"])
def test_container_types_count_alike(kind):
    ids, labels = [5, 6, 7, 8, 9], [5, -100, 7, 8, 9]
    convert = {"list": list, "tensor": torch.tensor, "numpy": np.array,   # bfloat16: no numpy view
               "bfloat16 tensor": lambda v: torch.tensor(v, dtype=torch.bfloat16)}[kind]
    cost = DefaultCost()({"input_ids": convert(ids), "labels": convert(labels)})
    assert cost == SampleCost(5, 3, 0)                     # 7, 8, 9 (the masked one is not counted)
    assert all(type(v) is int for v in cost)


def test_length_is_the_last_dimension_of_a_batched_tensor():
    sample = {"input_ids": torch.zeros(1, 7, dtype=torch.long), "labels": None}
    assert DefaultCost()(sample) == SampleCost(7, 7, 0)
    assert DefaultCost()({"input_ids": torch.tensor(3)}) == SampleCost(1, 1, 0)  # a 0-d id


def test_ignore_index_is_the_configured_value():
    sample = {"input_ids": [1, 2, 3, 4, 5], "labels": [7, -1, -100, -1, 9]}
    assert DefaultCost(ignore_index=-1)(sample).label_tokens == 2   # -100, 9
    assert DefaultCost(ignore_index=-100)(sample).label_tokens == 3  # -1, -1, 9


def test_without_labels_every_token_is_supervised():
    ids = [1, 2, 3, 4]
    assert DefaultCost()({"input_ids": ids}) == SampleCost(4, 4, 0)
    assert DefaultCost()({"input_ids": ids, "labels": None}) == SampleCost(4, 4, 0)
    assert DefaultCost(label_key=None)({"input_ids": ids, "labels": [-100] * 4}) == SampleCost(4, 4, 0)


def test_custom_keys():
    cost = DefaultCost(length_key="tokens", label_key="targets")
    sample = {"tokens": [1, 2, 3], "targets": [1, 2, -100], "input_ids": [0] * 50, "labels": [0] * 50}
    assert cost(sample) == SampleCost(3, 1, 0)


def test_a_sample_without_get_is_measured_by_its_ids():
    class Row:  # indexable by key, but no .get(): no labels or grid can be looked up
        def __getitem__(self, key):
            return {"input_ids": [1, 2, 3, IMAGE_PAD]}[key]

    cost = DefaultCost(vision_token_ids=[IMAGE_PAD], spatial_merge_size=1)
    assert cost(Row()) == SampleCost(4, 4, 1)


@pytest.mark.parametrize("sample", [{"labels": [1, 2]}, [1, 2, 3], None])
def test_missing_length_key_names_it(sample):
    with pytest.raises(MissingCostKeyError, match="no 'input_ids'.*ODBConfig.length_key") as info:
        DefaultCost()(sample)
    if isinstance(sample, dict):
        assert "['labels']" in str(info.value)
    else:
        assert type(sample).__name__ in str(info.value)


@settings(max_examples=600)
@given(st.lists(st.sampled_from([-100, -1, 0, 3, 7]), min_size=1, max_size=40),
       st.sampled_from([-100, -1]), st.booleans(), st.sampled_from(["list", "tensor"]))
def test_label_count_equals_a_positionwise_recount(labels, ignore_index, shift, kind):
    convert = torch.tensor if kind == "tensor" else list
    sample = {"input_ids": convert(list(range(len(labels)))), "labels": convert(labels)}
    cost = DefaultCost(ignore_index=ignore_index, label_shift=shift)(sample)
    assert cost.input_tokens == len(labels)
    assert cost.label_tokens == _supervised_after_shift(labels, ignore_index, shift)


# ------------------------------------------------------------------ vision patches

def test_patches_from_the_grid_are_the_sum_of_t_h_w():
    grid = [[1, 4, 6], [2, 2, 2]]                                   # 24 + 8
    for value in (grid, torch.tensor(grid), np.array(grid)):
        assert DefaultCost()({"input_ids": [1], "image_grid_thw": value}).vision_patches == 32
    assert DefaultCost()({"input_ids": [1], "image_grid_thw": [1, 4, 6]}).vision_patches == 24  # one row
    assert DefaultCost()({"input_ids": [1], "image_grid_thw": []}).vision_patches == 0


def test_a_grid_wins_over_counting_vision_tokens():
    cost = DefaultCost(vision_token_ids=[IMAGE_PAD])
    sample = {"input_ids": [IMAGE_PAD] * 5, "image_grid_thw": [[1, 2, 2]]}
    assert cost(sample).vision_patches == 4
    assert DefaultCost(image_grid_key="grid")({"input_ids": [1], "grid": [[3, 2, 5]]}).vision_patches == 30


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_without_a_grid_patches_are_vision_pads_times_merge_squared(merge):
    ids = [1, IMAGE_PAD, IMAGE_PAD, 2, VIDEO_PAD, IMAGE_PAD, 3]       # 3 image pads, 1 video pad
    image_only = DefaultCost(vision_token_ids=[IMAGE_PAD], spatial_merge_size=merge)
    both = DefaultCost(vision_token_ids=[IMAGE_PAD, VIDEO_PAD], spatial_merge_size=merge)
    for value in (ids, torch.tensor(ids)):
        assert image_only({"input_ids": value}).vision_patches == 3 * merge * merge
        assert both({"input_ids": value}).vision_patches == 4 * merge * merge
    assert DefaultCost()({"input_ids": ids}).vision_patches == 0    # no ids configured
    assert DefaultCost(vision_token_ids=[IMAGE_PAD])({"input_ids": ids}).vision_patches == 3 * 4  # merge 2


def test_from_config_takes_every_cost_option():
    cfg = ODBConfig(length_key="tokens", label_key="targets", ignore_index=-1,
                    image_grid_key="grid", vision_token_ids=(9,), spatial_merge_size=3,
                    label_shift=False, audio_token_ids=(5,))
    cost = DefaultCost.from_config(cfg)
    sample = {"tokens": [9, 9, 4, 5], "targets": [3, 4, -100, -1]}
    # unshifted (3 counts), ignore -1; one audio token of 4 frames
    assert cost(sample) == SampleCost(4, 3, 2 * 9, FRAMES_PER_AUDIO_TOKEN)
    assert cost({"tokens": [9], "grid": [[1, 1, 7]]}).vision_patches == 7


def test_vision_patches_reach_the_loader_steps_in_process():
    """The no-grid path end to end: each step's vision_patches is its samples' hand count."""
    from odb_factory import ODBDataLoader

    class VisionPads(torch.utils.data.Dataset):
        pads = [0, 3, 1, 5, 2, 0, 4, 6, 1, 2]

        def __len__(self):
            return len(self.pads)

        def __getitem__(self, i):
            ids = torch.tensor([1, 2] + [IMAGE_PAD] * self.pads[i] + [3, 4, 5])
            return {"input_ids": ids, "labels": ids.clone()}

    cfg = ODBConfig(token_budget=40, buffer_size=4, vision_token_ids=(IMAGE_PAD,),
                    spatial_merge_size=2, max_vision_patches=32)
    loader = ODBDataLoader(VisionPads(), cfg)
    try:
        seen = []
        for step in loader:
            assert step.vision_patches == sum(4 * VisionPads.pads[i] for i in step.indices)
            assert step.vision_patches <= 32 or step.num_samples == 1
            seen += step.indices
    finally:
        loader.close()
    assert sorted(seen) == list(range(10))


def test_audio_frames_from_the_feature_mask_or_the_audio_tokens():
    AUDIO = 77
    ids = [1, AUDIO, AUDIO, AUDIO, 2, AUDIO, 3]
    # valid frames of two padded clips: 10 + 3 (the padding beyond them is not audio)
    mask = torch.tensor([[1] * 10 + [0] * 6, [1] * 3 + [0] * 13])
    assert DefaultCost(audio_token_ids=[AUDIO])({"input_ids": ids, "feature_attention_mask": mask}) \
        == SampleCost(7, 7, 0, 13)
    # LLaMA-Factory's lazy samples carry only the expanded text: 4 audio tokens, 4 frames each
    assert DefaultCost(audio_token_ids=[AUDIO])({"input_ids": ids}).audio_frames == 16
    assert DefaultCost()({"input_ids": ids}).audio_frames == 0  # no audio ids: not counted


# ------------------------------------------------------------------ a chunk at a time

LABEL_KINDS = {"int64 tensor": torch.tensor, "int32 tensor": lambda v: torch.tensor(v, dtype=torch.int32),
               "list": list, "numpy": np.array, "2-D tensor": lambda v: torch.tensor([v])}


@settings(max_examples=400)
@given(st.lists(st.tuples(st.lists(st.sampled_from([-100, -1, 0, 3, 7]), max_size=12),
                          st.sampled_from(sorted(LABEL_KINDS)), st.booleans()), max_size=8),
       st.sampled_from([-100, -1]), st.booleans())
def test_many_counts_each_sample_as_the_positionwise_recount(rows, ignore_index, shift):
    """Mixed chunks too: one list, 2-D or int32 sample sends the chunk down the one-by-one path
    (a batched (1, n) sample shifts along its last dimension)."""
    samples, expected = [], []
    for labels, kind, has_labels in rows:
        sample = {"input_ids": list(range(len(labels)))}
        if has_labels:
            sample["labels"] = LABEL_KINDS[kind](labels)
        samples.append(sample)
        expected.append(_supervised_after_shift(labels, ignore_index, shift) if has_labels else len(labels))
    cost = DefaultCost(ignore_index=ignore_index, label_shift=shift)
    costs = cost.many(samples)
    assert costs == [cost(s) for s in samples]
    assert [c.label_tokens for c in costs] == expected
    assert all(type(c) is SampleCost and all(type(v) is int for v in c) for c in costs)


def test_many_by_hand_with_an_empty_sample_between_two():
    """An empty label tensor between two others: each sum stops at the next sample's start."""
    labels = [torch.tensor([7, -100, 3]), torch.tensor([], dtype=torch.long), torch.tensor([-100, 5, 6, -100])]
    samples = [{"input_ids": torch.zeros(len(t)), "labels": t} for t in labels]
    assert [c.label_tokens for c in DefaultCost().many(samples)] == [1, 0, 2]
    assert [c.label_tokens for c in DefaultCost(label_shift=False).many(samples)] == [2, 0, 2]
    assert DefaultCost().many([]) == []


def test_many_counts_a_chunk_of_tensors_without_counting_any_sample_alone(monkeypatch):
    """The chunk's labels are counted in one pass: the one-sample count is never reached."""
    import odb_factory.cost as cost_module
    labels = [torch.tensor([7, -100, 3]), torch.tensor([-100, 5, 6, -100])]
    samples = [{"input_ids": torch.zeros(len(t)), "labels": t} for t in labels]
    expected = DefaultCost().many(samples)

    def no_sample_alone(*args):
        raise AssertionError("a label tensor was counted on its own")

    monkeypatch.setattr(cost_module, "_count_not_equal", no_sample_alone)
    assert DefaultCost().many(samples) == expected == [SampleCost(3, 1), SampleCost(4, 2)]
    with pytest.raises(AssertionError, match="counted on its own"):
        DefaultCost().many([{"input_ids": [1, 2], "labels": [1, 2]}])   # lists: one by one


def test_a_subclass_that_measures_its_own_way_is_asked_one_sample_at_a_time():
    class Doubled(DefaultCost):
        def __call__(self, sample):
            cost = super().__call__(sample)
            return cost._replace(label_tokens=2 * cost.label_tokens)

    samples = [{"input_ids": torch.zeros(3), "labels": torch.tensor([1, 2, 3])}] * 2
    assert [c.label_tokens for c in Doubled().many(samples)] == [4, 4]


def test_a_chunk_with_a_bad_sample_names_it_by_its_dataset_index():
    from odb_factory.loader.sample_stage import CostedDataset
    rows = [{"input_ids": torch.zeros(2), "labels": torch.tensor([1, 2])}, {"text": "no ids"}]
    costed = CostedDataset(rows, DefaultCost())
    assert costed.fetch([0]) == [(0, rows[0], SampleCost(2, 1))]
    with pytest.raises(MissingCostKeyError, match=r"dataset sample 1: sample has no 'input_ids'.*\['text'\]"):
        costed.fetch([0, 1])


def test_a_cost_function_returning_tuples_gives_sample_costs_in_a_chunk():
    from odb_factory.loader.sample_stage import CostedDataset
    costed = CostedDataset([{"n": 3}, {"n": 5}], lambda s: (s["n"], 1))
    assert [c for _, _, c in costed.fetch([1, 0])] == [SampleCost(5, 1), SampleCost(3, 1)]
    assert all(type(c) is SampleCost for _, _, c in costed.fetch([1, 0]))


@pytest.mark.parametrize("bad, named", [
    ((0, 1), "input_tokens=0"), ((-5, 1), "input_tokens=-5"), ((2.5, 1), "input_tokens=2.5"),
    ((float("nan"), 1), "input_tokens=nan"), ((4, -1), "label_tokens=-1"), ((4, 1, 0.5), "vision_patches=0.5"),
    ((4, 1, 0, float("inf")), "audio_frames=inf"), ((4, "3"), "label_tokens='3'"), ((True, 1), "input_tokens=True"),
])
def test_a_cost_the_planner_cannot_plan_with_is_refused_naming_sample_and_value(bad, named):
    from odb_factory.cost import InvalidCostError
    from odb_factory.loader.sample_stage import CostedDataset
    costed = CostedDataset([{"n": 3}] * 5, lambda s: bad)
    with pytest.raises(InvalidCostError, match=rf"^dataset sample 4: the cost function returned {named}; costs are "
                                                r"whole counts, \w+ at least [01] "):
        costed.fetch([4])


def test_whole_counts_of_any_number_type_are_accepted_as_ints():
    from odb_factory.loader.sample_stage import CostedDataset
    costed = CostedDataset([{}], lambda s: (np.int64(7), 3.0, np.float32(2.0), 0))
    ((_, _, cost),) = costed.fetch([0])
    assert cost == SampleCost(7, 3, 2, 0) and all(type(v) is int for v in cost)


def test_bad_costs_are_refused_by_the_loader_before_any_step():
    from odb_factory import ODBDataLoader
    from odb_factory.cost import InvalidCostError
    from odb_factory.synthetic import LengthDataset, pad_collate
    loader = ODBDataLoader(LengthDataset([5, 6, 7, 8]), ODBConfig(token_budget=32), collate_fn=pad_collate,
                           cost_fn=lambda s: SampleCost(0, 1))
    try:
        with pytest.raises(InvalidCostError, match="input_tokens=0"):
            next(iter(loader))
    finally:
        loader.close()
