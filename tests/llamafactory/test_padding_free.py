"""Padding-free groups equal padded groups: in fp64, every sample's loss and every parameter's
gradient from one packed row (pack_group on LLaMA-Factory's real collator output) equal those of
the same samples padded, for Qwen3-VL, Qwen2.5-VL and Qwen3 (text, images, multi-image rows,
video, rows cut at cutoff_len, a group without media) and a text-only Llama, under both packed
attentions: transformers' block mask and per-segment sdpa (`odb_factory.segment_attention`), and
with logits at the supervised positions only (`odb_supervised_logits`, the trainer's loss)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("llamafactory")

from odb_factory.llamafactory.padding_free import (TOKEN_SAMPLE_KEY, pack_group,  # noqa: E402
                                                   padding_free_refusal, token_weights)
from odb_factory.loss import supervised_positions, weighted_token_sum  # noqa: E402
from odb_factory.segment_attention import SEGMENT_ATTENTION, decoder_config, packed_attention  # noqa: E402
from tests.helpers import lf_runs  # noqa: E402

TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
RELATIVE = 1e-10


def _real_data(root: Path) -> Path:
    demo = lf_runs.SHARED_DEMO
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": str(demo / "alpaca_en_demo.json")},
        "mllm_demo": {"file_name": str(demo / "mllm_demo.json"), "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"}, "tags": TAGS},
        "mllm_video_demo": {"file_name": str(demo / "mllm_video_demo.json"), "formatting": "sharegpt",
                            "columns": {"messages": "messages", "videos": "videos"}, "tags": TAGS}}))
    return root


def _lf_pieces(model_dir: Path, data_dir: Path, out: Path, **overrides):
    """(dataset, ODB's collate, fp64 model) as `run_sft` builds them."""
    import llamafactory.train.tuner  # noqa: F401  (the import hook applies the patches here)
    import odb_factory_patches
    odb_factory_patches.apply()
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    from odb_factory.llamafactory.run import attach
    from odb_factory.llamafactory.train_loader import LFCollate
    config = lf_runs.base_yaml(model_dir, data_dir, out, media_dir=str(lf_runs.SHARED_DEMO),
                               freeze_vision_tower=False, video_max_pixels=16384, video_fps=1.0,
                               video_maxlen=4, **overrides)
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    attach(None, data_args)  # plain LLaMA-Factory datasets (eager), no ODB loader
    dataset = get_dataset(template, model_args, data_args, training_args, "sft", **tokenizer_module)["train_dataset"]
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, True).double()
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=-100,
        attn_implementation=model.config._attn_implementation, compute_dtype=torch.float64, **tokenizer_module)
    return dataset, LFCollate(collator), model


def _fp64(batch):
    return {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}


def _per_token_loss(model, batch):
    batch = dict(batch)
    labels = batch.pop("labels")
    batch.pop(TOKEN_SAMPLE_KEY, None)
    logits = model(**batch).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="none")
    return loss.view(labels.shape[0], -1), labels[:, 1:]


def _losses_and_grads(model, batch, sample_of_token, weights):
    """(per-sample summed token losses, gradients of Σ weights·losses)."""
    model.zero_grad(set_to_none=True)
    per_token, labels = _per_token_loss(model, batch)
    owner = sample_of_token[:, 1:]
    losses = torch.stack([per_token[owner == s].sum() for s in range(len(weights))])
    (losses * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert all(int((labels[owner == s] != -100).sum()) > 0 for s in range(len(weights))), "every sample supervised"
    return losses.detach(), grads


def _supervised_logits_loss_and_grads(model, batch, sample_of_token, weights):
    """The trainer's loss with `odb_supervised_logits`: logits at the supervised positions only,
    each token weighed by its sample's weight (Σ weights·losses), and its gradients."""
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    labels = batch.pop("labels")
    batch.pop(TOKEN_SAMPLE_KEY, None)
    positions = supervised_positions(labels)
    assert len(positions) < labels.shape[-1]  # prompt positions left out
    logits = model(**batch, logits_to_keep=positions).logits
    assert logits.shape[-2] == len(positions)
    per_token = torch.where(sample_of_token >= 0, weights[sample_of_token.clamp(min=0)], 0.0)
    total = weighted_token_sum(logits, labels, per_token, positions=positions)
    total.backward()
    return total.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(what, loss, expected_loss, grads, expected_grads):
    """Losses and every parameter's gradient equal within RELATIVE (gradients: of their largest entry)."""
    assert torch.allclose(loss, expected_loss, rtol=RELATIVE, atol=0), (what, loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-300)
        assert float((grads[name] - grad).abs().max() / scale) <= RELATIVE, (what, name)


def assert_packed_equals_padded(model, collate, features, row_tokens=None):
    """The check itself: the same samples padded (LLaMA-Factory's batch) and packed."""
    import copy
    torch.manual_seed(0)
    weights = torch.rand(len(features), dtype=torch.float64) + 0.5
    padded = collate(copy.deepcopy(features))
    rows, width = padded["input_ids"].shape
    padded_owner = torch.arange(rows).unsqueeze(1).expand(rows, width)
    lengths = [len(f["input_ids"]) for f in features]
    fresh = copy.deepcopy(features)
    placeholder_batch = collate(fresh)
    placeholder = len(fresh[0]["input_ids"]) - lengths[0]
    packed = pack_group(placeholder_batch, lengths, placeholder, row_tokens, pad_token_id=3)
    if row_tokens is None:
        assert packed["input_ids"].shape == (1, sum(lengths) + placeholder)
    else:  # several rows, each at most row_tokens long unless one sample is longer
        assert packed["input_ids"].shape[0] > 1
        assert packed["input_ids"].shape[1] <= max(row_tokens, *lengths)
        assert int((packed[TOKEN_SAMPLE_KEY] >= 0).sum()) == sum(lengths)
    assert "attention_mask" not in packed and packed["use_cache"] is False
    decoder = decoder_config(model)
    decoder._attn_implementation = "sdpa"
    loss_padded, grad_padded = _losses_and_grads(model, _fp64(padded), padded_owner, weights)
    # the packed row under both attentions of odb_packed_attention (transformers' dense block mask,
    # then one causal sdpa call per segment), and the padded batch again under the second
    checks = [("mask", packed, packed[TOKEN_SAMPLE_KEY]), ("segments", packed, packed[TOKEN_SAMPLE_KEY]),
              ("segments", padded, padded_owner)]
    for attention, batch, owner in checks:
        assert packed_attention(model, attention) == attention
        assert decoder._attn_implementation == {"mask": "sdpa", "segments": SEGMENT_ATTENTION}[attention]
        loss, grads = _losses_and_grads(model, _fp64(batch), owner, weights)
        _assert_equal(attention, loss, loss_padded, grads, grad_padded)
    # the trainer's loss with logits at the supervised positions only, packed and padded
    for batch, owner in ((packed, packed[TOKEN_SAMPLE_KEY]), (padded, padded_owner)):
        total, grads = _supervised_logits_loss_and_grads(model, _fp64(batch), owner, weights)
        _assert_equal("supervised logits", total, (loss_padded * weights).sum(), grads, grad_padded)
    decoder._attn_implementation = "sdpa"
    return packed


@pytest.fixture(scope="module")
def real_data(tmp_path_factory):
    if not lf_runs.SHARED_DEMO.exists():
        pytest.skip("shared LLaMA-Factory demo data is absent")
    return _real_data(tmp_path_factory.mktemp("real"))


def _kinds(dataset):
    """Indices of rows with several images, one video, and none (text)."""
    multi = [i for i in range(len(dataset)) if len(dataset[i].get("images") or []) > 1]
    video = [i for i in range(len(dataset)) if dataset[i].get("videos")]
    text = [i for i in range(len(dataset)) if not dataset[i].get("images") and not dataset[i].get("videos")]
    assert multi and video and len(text) >= 3
    return multi, video, text


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen2_5_vl"])
def test_vl_packed_row_equals_padded_batch(tmp_path, tiny_model, real_data, kind):
    if kind == "qwen3_vl":
        model_dir, template = tiny_model, "qwen3_vl_nothink"
    else:
        from odb_factory.demo.tiny_qwen25vl import build_tiny_qwen25vl
        model_dir, template = build_tiny_qwen25vl(tmp_path / "tiny_qwen25vl", seed=0), "qwen2_vl"
    dataset, collate, model = _lf_pieces(model_dir, real_data, tmp_path / "out", template=template,
                                         dataset="mllm_demo,mllm_video_demo,alpaca_en_demo", max_samples=6)
    multi, video, text = _kinds(dataset)
    groups = {"images, video and text": [multi[0], video[0], text[0]],
              "videos": video[:2], "text only (the collator's placeholder image)": text[:3]}
    for name, indices in groups.items():
        packed = assert_packed_equals_padded(model, collate, [dict(dataset[i]) for i in indices])
        owners = packed[TOKEN_SAMPLE_KEY][0].tolist()
        assert (-1 in owners) == name.startswith("text only"), name
    # several rows per group (odb_padding_free_row_tokens): images stay in sample order across rows
    mixed = [dict(dataset[i]) for i in groups["images, video and text"] + text[1:3]]
    assert_packed_equals_padded(model, collate, mixed, row_tokens=max(len(f["input_ids"]) for f in mixed))
    # rows cut at cutoff_len (text rows: LLaMA-Factory truncates them)
    cut, collate, model = _lf_pieces(model_dir, real_data, tmp_path / "cut", template=template,
                                     dataset="alpaca_en_demo", max_samples=4, cutoff_len=48)
    assert max(len(cut[i]["input_ids"]) for i in range(4)) == 48
    assert_packed_equals_padded(model, collate, [dict(cut[i]) for i in range(4)])


def test_text_model_packed_row_equals_padded_batch(tmp_path, real_data):
    from odb_factory.demo.tiny_qwen3 import build_tiny_qwen3
    model_dir = build_tiny_qwen3(tmp_path / "tiny_qwen3", seed=0)
    dataset, collate, model = _lf_pieces(model_dir, real_data, tmp_path / "out", template="qwen3_nothink",
                                         dataset="alpaca_en_demo", max_samples=5, cutoff_len=96)
    packed = assert_packed_equals_padded(model, collate, [dict(dataset[i]) for i in range(5)])
    assert packed["position_ids"].shape == packed["input_ids"].shape
    rows = assert_packed_equals_padded(model, collate, [dict(dataset[i]) for i in range(5)], row_tokens=100)
    assert rows["position_ids"].shape == rows["input_ids"].shape


def test_llama_packed_row_equals_padded_batch():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).double()
    lengths = [9, 3, 14, 6]
    features = [{"input_ids": torch.randint(1, 64, (n,)).tolist()} for n in lengths]
    for f in features:
        f["labels"] = [-100] + f["input_ids"][1:]

    def collate(batch_features):
        width = max(len(f["input_ids"]) for f in batch_features)
        pad = [width - len(f["input_ids"]) for f in batch_features]
        rows = list(zip(batch_features, pad))
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * p for f, p in rows]),
                "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * p for f, p in rows]),
                "labels": torch.tensor([f["labels"] + [-100] * p for f, p in rows])}
    assert_packed_equals_padded(model, collate, features)


def test_pack_group_layout_and_errors():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "labels": torch.tensor([[-100, 6, 7, -100], [-100, 9, -100, -100]]),
             "position_ids": torch.arange(4).repeat(4, 2, 1), "rope_deltas": torch.zeros(2, 1),
             "pixel_values": torch.ones(3, 2)}
    packed = pack_group(batch, [3, 2])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert packed["position_ids"].shape == (4, 1, 5)
    assert packed["position_ids"][0, 0].tolist() == [0, 1, 2, 0, 1]
    assert packed[TOKEN_SAMPLE_KEY].tolist() == [[0, 0, 0, 1, 1]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 5] and packed["cu_seq_lens_q"].dtype == torch.int32
    assert packed["cu_seq_lens_k"] is packed["cu_seq_lens_q"] and packed["max_length_q"] == packed["max_length_k"] == 3
    assert "rope_deltas" not in packed and packed["pixel_values"] is batch["pixel_values"]
    two_rows = pack_group(batch, [3, 2], row_tokens=3, pad_token_id=0)
    assert two_rows["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert two_rows["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert two_rows[TOKEN_SAMPLE_KEY].tolist() == [[0, 0, 0], [1, 1, -1]]
    assert two_rows["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]  # the second row's padding: a segment of its own
    assert two_rows["position_ids"].shape == (4, 2, 3) and two_rows["position_ids"][0].tolist() == [[0, 1, 2], [0, 1, 0]]
    # a row exactly as long as row_tokens holds both samples (the cut is for what would go over)
    assert pack_group(batch, [3, 2], row_tokens=5)["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert pack_group(batch, [3, 2], row_tokens=4)["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    with_placeholder = pack_group(batch, [2, 2], placeholder=1)
    assert with_placeholder[TOKEN_SAMPLE_KEY].tolist() == [[0, 0, 1, 1, -1]]
    assert with_placeholder["cu_seq_lens_q"].tolist() == [0, 2, 4, 5]
    assert with_placeholder["labels"].tolist() == [[-100, 6, -100, 9, -100]]
    assert token_weights([0.5, 2.0], with_placeholder[TOKEN_SAMPLE_KEY]).tolist() == [[0.5, 0.5, 2.0, 2.0, 0.0]]
    left = dict(batch, attention_mask=torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]]))
    with pytest.raises(ValueError, match="padding_side: right"):
        pack_group(left, [3, 2])
    with pytest.raises(ValueError, match="2 lengths for a batch of 2 rows|3 lengths"):
        pack_group(batch, [3, 2, 1])


def test_pack_group_keeps_each_samples_rope_positions_and_names_bad_inputs():
    """Rows 1-3 of a Qwen-VL position tensor are each sample's own rope positions (distinct
    values here, so a wrong row, sample or slice shows); row 0 restarts per sample."""
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "labels": torch.tensor([[-100, 6, 7, -100], [-100, 9, -100, -100]])}
    rope = torch.arange(3 * 2 * 4).reshape(3, 2, 4) + 100  # (t, h, w) x row x token
    for positions in (rope, torch.cat([torch.zeros(1, 2, 4, dtype=torch.long), rope])):
        packed = pack_group(dict(batch, position_ids=positions), [3, 2], placeholder=1)
        assert packed["position_ids"].tolist() == [
            [[0, 1, 2, 0, 1, 0]],
            [[100, 101, 102, 104, 105, 0]],
            [[108, 109, 110, 112, 113, 0]],
            [[116, 117, 118, 120, 121, 0]]]
        two_rows = pack_group(dict(batch, position_ids=positions), [3, 2], row_tokens=3)
        assert two_rows["position_ids"].tolist() == [
            [[0, 1, 2], [0, 1, 0]],
            [[100, 101, 102], [104, 105, 0]],
            [[108, 109, 110], [112, 113, 0]],
            [[116, 117, 118], [120, 121, 0]]]
    text = pack_group(dict(batch, position_ids=torch.arange(4).repeat(2, 1) + 7), [3, 2], row_tokens=3)
    assert text["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    plain = pack_group(batch, [3, 2], row_tokens=3)   # no position ids: each sample's arange
    assert plain["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]] and plain["use_cache"] is False
    assert "attention_mask" not in plain and plain["max_length_q"] == plain["max_length_k"] == 3
    assert plain["cu_seq_lens_k"].tolist() == [0, 3, 5, 6]
    with pytest.raises(ValueError, match=re.escape("pack_group: position_ids of shape (3, 2, 5) for a batch "
                                                   "of 2x4")):
        pack_group(dict(batch, position_ids=torch.zeros(3, 2, 5, dtype=torch.long)), [3, 2])
    with pytest.raises(ValueError, match=re.escape("pack_group: position_ids of shape (2, 2, 2, 4) for a batch")):
        pack_group(dict(batch, position_ids=torch.zeros(2, 2, 2, 4, dtype=torch.long)), [3, 2])
    with pytest.raises(ValueError, match=re.escape("pack_group: lengths [4, 2] (+1) exceed the batch width 4")):
        pack_group(batch, [4, 2], placeholder=1)
    with pytest.raises(ValueError, match=re.escape("pack_group: lengths [3, 5] (+0) exceed the batch width 4")):
        pack_group(batch, [3, 5])
    # the placeholder (row 0 after its real tokens) goes after every sample
    assert pack_group(batch, [3, 2], placeholder=1)["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0]]
    with pytest.raises(ValueError, match=re.escape("pack_group: 1 lengths for a batch of 2 rows")):
        pack_group(batch, [3])
    with pytest.raises(ValueError, match=re.escape("pack_group: a row's real tokens are not its first tokens "
                                                   "(left padding?); padding-free rows need the tokenizer's "
                                                   "padding_side: right")):
        pack_group(dict(batch, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])), [3, 2])
    # a 4-d mask (a model's own) is not read as the collator's padding
    assert pack_group(dict(batch, attention_mask=torch.zeros(2, 1, 4, 4)), [3, 2])["input_ids"].tolist() == [
        [5, 6, 7, 8, 9]]


def test_rows_are_cut_where_the_next_sample_would_go_over_and_every_tensor_is_padded_as_its_kind():
    ids = torch.tensor([[1, 1, 1, 0], [2, 2, 0, 0], [3, 0, 0, 0]])
    batch = {"input_ids": ids, "labels": ids.clone(), "token_type_ids": torch.ones(3, 4, dtype=torch.long),
             "embeds": torch.ones(3, 4, 2), "position_ids": torch.arange(4, dtype=torch.int32).repeat(3, 1)}
    packed = pack_group(batch, [3, 2, 1], row_tokens=3, pad_token_id=9)
    assert packed["input_ids"].tolist() == [[1, 1, 1], [2, 2, 3]]   # 2 + 1 fit a row of 3
    assert packed["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert packed["position_ids"].dtype == torch.int32   # the collator's dtype
    ones = {"input_ids": torch.tensor([[4, 0], [5, 0], [6, 0]]), "labels": torch.tensor([[4, 0], [5, 0], [6, 0]])}
    cut = pack_group(ones, [1, 1, 1], row_tokens=2, pad_token_id=9)
    assert cut["input_ids"].tolist() == [[4, 5], [6, 9]] and cut["labels"].tolist() == [[-100, -100], [-100, -100]]
    padded = pack_group(batch, [3, 2, 1], row_tokens=5, pad_token_id=9)
    assert padded["input_ids"].tolist() == [[1, 1, 1, 2, 2], [3, 9, 9, 9, 9]]
    assert padded["token_type_ids"].tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]   # other tensors pad with 0
    assert padded["embeds"].shape == (2, 5, 2) and padded["embeds"][1, 1:].abs().sum() == 0
    assert padded["embeds"][0].eq(1).all() and padded["embeds"][1, 0].eq(1).all()
    # no position ids from the collator, and its placeholder: each piece restarts at 0
    placeholder = pack_group({"input_ids": torch.tensor([[1, 1, 7, 7], [2, 2, 2, 0]])}, [2, 3], placeholder=2,
                             row_tokens=5)
    assert placeholder["input_ids"].tolist() == [[1, 1, 2, 2, 2], [7, 7, 0, 0, 0]]
    assert placeholder["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2]]
    assert placeholder[TOKEN_SAMPLE_KEY].tolist() == [[0, 0, 1, 1, 1], [-1, -1, -1, -1, -1]]
    fits = pack_group({"input_ids": torch.tensor([[1, 1, 7, 7], [2, 0, 0, 0]])}, [2, 1], placeholder=2, row_tokens=5)
    assert fits["input_ids"].tolist() == [[1, 1, 2, 7, 7]]   # the placeholder counts its own 2 tokens


def test_packed_collate_finds_the_placeholder_the_collator_appends_and_counts_real_tokens():
    """LLaMA-Factory's collator appends its placeholder image's tokens to the first feature in
    place: PackedCollate reads their number from the feature's new length."""
    from odb_factory.llamafactory.padding_free import PackedCollate, counted_tokens

    def collate(features, placeholder=(7, 7)):
        features[0]["input_ids"] = features[0]["input_ids"] + list(placeholder)
        features[0]["labels"] = features[0]["labels"] + [-100] * len(placeholder)
        width = max(len(f["input_ids"]) for f in features)
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]),
                "labels": torch.tensor([f["labels"] + [-100] * (width - len(f["labels"])) for f in features])}
    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    packed = PackedCollate(collate, row_tokens=None, pad_token_id=3)([dict(f) for f in features])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 7, 7]]
    assert packed[TOKEN_SAMPLE_KEY].tolist() == [[0, 0, 0, 1, 1, -1, -1]]
    rows = PackedCollate(collate, row_tokens=4, pad_token_id=3)([dict(f) for f in features])
    assert rows["input_ids"].tolist() == [[5, 6, 7, 3], [8, 9, 7, 7]]   # padded with the pad token
    counted = counted_tokens(rows)   # a packed row's real tokens: its samples', as a mask
    assert sorted(counted) == ["attention_mask", "input_ids"] and counted["input_ids"] is rows["input_ids"]
    assert counted["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert counted["attention_mask"].dtype == torch.long
    padded = {"input_ids": torch.ones(1, 2), "attention_mask": torch.ones(1, 2)}
    assert counted_tokens(padded) is padded   # a padded batch counts as HF counts it


def test_refusal_names_the_supported_models():
    assert padding_free_refusal("qwen3_vl") is None
    assert "gemma3" in padding_free_refusal("gemma3") and "odb_padding_free: false" in padding_free_refusal("gemma3")


def test_segment_attention_rows_and_refusals():
    """Several rows laid end to end equal each row alone; what cannot be a packed row is refused."""
    from odb_factory.segment_attention import segment_attention_forward
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query, key, value = torch.randn(2, 4, 6, 8).double(), torch.randn(2, 2, 6, 8).double(), torch.randn(2, 2, 6, 8).double()
    bounds = torch.tensor([0, 2, 6, 9, 12], dtype=torch.int32)  # row 0: 2 + 4 tokens; row 1: 3 + 3
    out, weights = segment_attention_forward(module, query, key, value, None, cu_seq_lens_q=bounds)
    assert weights is None and out.shape == (2, 6, 4, 8)
    for row, cuts in ((0, (0, 2, 6)), (1, (0, 3, 6))):
        for start, end in zip(cuts, cuts[1:]):
            alone = F.scaled_dot_product_attention(query[row:row + 1, :, start:end],
                                                   key[row:row + 1, :, start:end].repeat_interleave(2, 1),
                                                   value[row:row + 1, :, start:end].repeat_interleave(2, 1),
                                                   is_causal=True)
            assert torch.allclose(out[row, start:end], alone[0].transpose(0, 1), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 2, 6\] does not cut the 2x6 tokens"):
        segment_attention_forward(module, query, key, value, None, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match="carries no attention mask"):
        segment_attention_forward(module, query, key, value, torch.ones(2, 1, 6, 6, dtype=torch.bool),
                                  cu_seq_lens_q=bounds)
    with pytest.raises(ValueError, match="share their segments"):
        segment_attention_forward(module, query, key, value, None, cu_seq_lens_q=bounds,
                                  cu_seq_lens_k=torch.tensor([0, 12], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        segment_attention_forward(module, query, key, value, None, cu_seq_lens_q=bounds, sliding_window=4)
