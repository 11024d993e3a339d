"""The lazy dataset of stages pt and dpo, in-process: each sample is the one LLaMA-Factory's own
eager `datasets.map` builds, and the rows left out up front are exactly the rows upstream's
processors drop."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("llamafactory")

from tests.helpers.lf_runs import base_yaml, lazy_and_eager  # noqa: E402

# stage (as the recipe names it) -> LLaMA-Factory's data stage
DATA_STAGES = {"sft": "sft", "pt": "pt", "dpo": "rm"}


def _config(stage, model, data, out):
    dataset = {"sft": "alpaca", "pt": "docs", "dpo": "pairs"}[stage]
    return base_yaml(model, data, out, stage=stage, dataset=dataset, template="qwen3_nothink", cutoff_len=96,
                     max_samples=40, odb_enable=True, **({"pref_beta": 0.1} if stage == "dpo" else {}))


@pytest.fixture(scope="module")
def stage_data(tmp_path_factory, pt_data, pair_data):
    """One dataset_dir holding the demo file as instructions (sft), documents (pt) and pairs (dpo)."""
    info = json.loads((pt_data / "dataset_info.json").read_text())
    info.update(json.loads((pair_data / "dataset_info.json").read_text()))
    info["alpaca"] = {"file_name": info["docs"]["file_name"]}
    data = tmp_path_factory.mktemp("stage_data")
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


@pytest.mark.parametrize("stage", ["pt", "dpo"])
def test_lazy_samples_are_upstreams_eager_samples(lf, tmp_path, text_model, stage_data, stage):
    from odb_factory.llamafactory.lazy_dataset import LazySupervisedDataset
    lazy, eager = lazy_and_eager(lf, _config(stage, text_model, stage_data, tmp_path / "o"), DATA_STAGES[stage])
    assert isinstance(lazy, LazySupervisedDataset)
    assert lazy.pairwise == (stage == "dpo")
    assert len(lazy) == len(eager) > 0
    keys = {"pt": ["input_ids", "attention_mask"],
            "dpo": ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]}[stage]
    truncated = 0
    for i in range(len(eager)):
        sample = lazy[i]
        assert {k: sample[k] for k in keys} == {k: eager[i][k] for k in keys}, i
        assert lazy.dataset_row(i) == i   # the demo file has no malformed row
        truncated += len(sample[keys[0]]) == 96
    assert truncated, "no sample reached cutoff_len: the text-only truncation path was not taken"


def _converted_row(prompt_turns, responses, content="hello there"):
    roles = ["user", "assistant"]
    return {"_prompt": [{"role": roles[t % 2], "content": content} for t in range(prompt_turns)],
            "_response": [{"role": "assistant", "content": f"answer {r}"} for r in range(responses)],
            "_system": "", "_tools": "", "_images": None, "_videos": None, "_audios": None}


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_rows_left_out_up_front_are_the_rows_upstream_drops(lf, tmp_path, text_model, stage_data, stage):
    """Every shape of converted row (0–4 prompt turns, 0–3 responses): `trainable_row` keeps a
    row exactly when LLaMA-Factory's processor of the data stage makes a sample of it."""
    from llamafactory.data import loader

    from odb_factory.llamafactory.lazy_dataset import trainable_row
    get_train_args, load_tokenizer, get_template, _ = lf
    model_args, data_args, _, _, _ = get_train_args(_config(stage, text_model, stage_data, tmp_path / "o"))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template(tokenizer_module["tokenizer"], data_args)
    processor = loader._get_dataset_processor(data_args, DATA_STAGES[stage], template, **tokenizer_module)
    kept = 0
    for turns, responses in itertools.product(range(5), range(4)):
        row = _converted_row(turns, responses)
        if turns == 0 and responses == 0:
            continue   # nothing to template: upstream's converter never yields it
        made = processor.preprocess_dataset({k: [v] for k, v in row.items()})
        upstream = bool(next(iter(made.values()), None))
        assert trainable_row(row["_prompt"], row["_response"], DATA_STAGES[stage]) == upstream, (turns, responses)
        kept += upstream
    assert kept == (2 if stage == "sft" else 4)   # 1 or 3 prompt turns; one response (sft), two or three (dpo)


def test_a_document_is_its_first_prompt_turns_text():
    from odb_factory.llamafactory.lazy_dataset import trainable_row
    doc = [{"role": "user", "content": "some text"}]
    assert trainable_row(doc, [], "pt")
    assert trainable_row(doc + [{"role": "assistant", "content": ""}], [], "pt")  # what follows is not read
    assert not trainable_row([], [], "pt")
    assert not trainable_row([{"role": "user", "content": ""}], [], "pt")
    assert not trainable_row([{"role": "user"}], [], "pt")
    # the same rows under the other data stages: sft wants one response, rm (dpo) two
    assert not trainable_row(doc, [], "sft")
    assert trainable_row(doc, [{"content": "a"}], "sft")
    assert not trainable_row(doc, [{"content": "a"}], "rm")
    assert trainable_row(doc, [{"content": "a"}, {"content": "b"}], "rm")


def test_image_pairs_cut_by_cutoff_len_are_named_by_row(lf, tmp_path, tiny_model):
    """Stage dpo on image rows: each side of a pair is checked for the image tokens cutoff_len
    cut, and the error names the row."""
    from PIL import Image

    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    data = tmp_path / "pairs"
    data.mkdir()
    rows = []
    for i in range(3):
        Image.new("RGB", (64, 64), (60 * i, 90, 200)).save(data / f"img{i}.png")
        rows.append({"conversations": [{"from": "human", "value": "<image>Colour?"}],
                     "chosen": {"from": "gpt", "value": "Blue."}, "rejected": {"from": "gpt", "value": "Red."},
                     "images": [f"img{i}.png"]})
    (data / "pairs.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"image_pairs": {
        "file_name": "pairs.json", "formatting": "sharegpt", "ranking": True,
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"}}}))
    config = base_yaml(tiny_model, data, tmp_path / "o", stage="dpo", dataset="image_pairs", media_dir=str(data),
                       odb_enable=True, pref_beta=0.1, cutoff_len=6)   # no room for a whole image
    with pytest.raises(TruncatedVisionTokensError) as caught:
        lazy_and_eager(lf, config, "rm")
    lines = str(caught.value).splitlines()
    assert [line.split(": cutoff_len=6 cuts into its image tokens (kept ")[0] for line in lines[1:4]] == \
        [f"  training row {i}" for i in range(3)]


class _DroppingProcessor:
    """A dataset processor that makes no sample of a row (as a later LLaMA-Factory might, for a
    reason `trainable_row` does not know): empty columns, or none at all."""

    def __init__(self, out):
        self.out = out

    def preprocess_dataset(self, batch):
        return self.out


def test_a_row_the_processor_drops_after_all_is_named():
    import datasets

    from odb_factory.llamafactory.lazy_dataset import LazySupervisedDataset
    converted = datasets.Dataset.from_list([_converted_row(1, 1), _converted_row(2, 1), _converted_row(1, 1)])
    for out in ({"input_ids": [], "labels": []}, {}):
        lazy = LazySupervisedDataset(converted, _DroppingProcessor(out), "sft")
        assert lazy.rows == [0, 2] and not lazy.pairwise and lazy.column_names == converted.column_names
        with pytest.raises(ValueError, match=r"^LLaMA-Factory's preprocessing dropped training row 2$"):
            lazy[1]
    with pytest.raises(ValueError, match=r"lacks columns \['_response'\]; is it an SFT dataset\?"):
        LazySupervisedDataset(converted.remove_columns("_response"), _DroppingProcessor({}), "sft")
