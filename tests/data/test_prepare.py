"""`python -m odb_factory.data prepare`: every data set from a few records written in its
published layout (tiny real images), through the real command, into files that LLaMA-Factory's
own loader reads; the token counts it prints equal what LLaMA-Factory builds; bad input stops
it with the rows and files named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
Image = pytest.importorskip("PIL.Image")

from odb_factory.data import formats, layouts, registry
from odb_factory.data.layouts import SHAREGPT4O_IMAGES

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
# Sizes the tiny Qwen3-VL's processor (32*32 .. 512*512 px) and the Qwen3-VL rule of
# odb_factory.token_lengths treat alike at image_max_pixels=262144; 640x480 is shrunk first.
MAX_PIXELS = 262144


def image(path: Path, size, fmt: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (size[0] % 256, 90, size[1] % 256)).save(path, fmt)


def turns(*texts):
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(texts)]


def write_ultrachat(raw: Path) -> None:
    (raw / "data").mkdir(parents=True)
    def msgs(*texts):
        return [{"content": t, "role": "user" if i % 2 == 0 else "assistant"} for i, t in enumerate(texts)]
    rows = [{"prompt": "Hi?", "prompt_id": "u0", "messages": msgs("Hi?", "Hello! " * 40)},
            {"prompt": "Tell", "prompt_id": "u1", "messages": msgs("Tell", "A story " * 300, "More", "Fine.")},
            {"prompt": "Odd", "prompt_id": "u2", "messages": msgs("Odd", "reply", "unanswered")}]
    pq.write_table(pa.Table.from_pylist(rows), raw / "data/train_sft-00000-of-00001-0a1b2c.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "t", "prompt_id": "TEST", "messages": msgs("t", "x")}]),
                   raw / "data/test_sft-00000-of-00001-ffff.parquet")


def write_alpaca(raw: Path) -> None:
    (raw / "data").mkdir(parents=True)
    rows = [{"instruction": "Add 2 and 3.", "input": "", "output": "5", "text": "..."},
            {"instruction": "Translate", "input": "Hallo", "output": "Hello", "text": "..."}]
    pq.write_table(pa.Table.from_pylist(rows), raw / "data/train-00000-of-00001-a09b74b3ef9c3b56.parquet")


def write_llava150k(raw: Path) -> None:
    rows = [{"id": "000000033471", "image": "000000033471.jpg",
             "conversations": turns("What is on the bus?\n<image>", "A banner.", "Colour?", "Red.")},
            {"id": "000000052846", "image": "000000052846.jpg",
             "conversations": turns("<image>\nDescribe the scene.", "A street " * 30)}]
    raw.mkdir(parents=True)
    (raw / "llava_instruct_150k.json").write_text(json.dumps(rows, indent=1))
    image(raw / "coco/train2017/000000033471.jpg", (640, 480))
    image(raw / "coco/train2017/000000052846.jpg", (256, 384))


def write_llava665k(raw: Path) -> None:
    rows = [{"id": "t0", "model": "", "conversations": turns("Write a poem.", "Roses " * 20)},
            {"id": 97, "image": "coco/train2017/000000000097.jpg",
             "conversations": turns("<image>\nWhat is it?", "A cat.")},
            {"id": "n1", "image": "gqa/images/n1.jpg", "conversations": turns("<image>\nLeft?", "Yes.")},
            {"id": "o1", "image": "ocr_vqa/images/o1.jpg", "conversations": turns("<image>\nTitle?", "X.")},
            {"id": "x1", "image": "textvqa/train_images/x1.jpg", "conversations": turns("<image>\nText?", "Stop")},
            {"id": "v1", "image": "vg/VG_100K/1.jpg", "conversations": turns("<image>\nBox?", "[0.1, 0.2]")},
            {"id": "v2", "image": "vg/VG_100K_2/2.jpg", "conversations": turns("<image>\nWhere?", "Here.")},
            {"id": "bad", "conversations": turns("Two <image> <image>", "no images")}]
    raw.mkdir(parents=True)
    (raw / "llava_v1_5_mix665k.json").write_text(json.dumps(rows))
    image(raw / "coco/train2017/000000000097.jpg", (320, 256))
    image(raw / "gqa/images/n1.jpg", (288, 288), "PNG")  # a PNG named .jpg, as some downloads are
    for name in ("ocr_vqa/images/o1.jpg", "textvqa/train_images/x1.jpg", "vg/VG_100K/1.jpg",
                 "vg/VG_100K_2/2.jpg"):
        image(raw / name, (256, 256))


def write_sharegpt4o(raw: Path) -> None:
    rows = [{"image": f"sa_{i}.jpg", "width": 512, "height": 384,
             "conversations": turns(("<image>\n" if i else "") + "Describe the image in detail.",
                                    "In this image " + "there is a detailed scene " * (20 + 30 * i))}
            for i in range(4)]
    (raw / "image_conversations").mkdir(parents=True)
    (raw / "image_conversations/gpt-4o.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i in range(4):
        image(raw / SHAREGPT4O_IMAGES / f"sa_{i}.jpg", (512, 384))


WRITERS = {"ultrachat": write_ultrachat, "alpaca": write_alpaca, "llava150k": write_llava150k,
           "llava665k": write_llava665k, "sharegpt4o": write_sharegpt4o}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """One folder per data set in its published layout; the folder itself is an MM-Mix --raw."""
    root = tmp_path_factory.mktemp("raw")
    for key, write in WRITERS.items():
        write(root / key)
    return root


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "odb_factory.data", "prepare", *map(str, args)],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def rows_of(out: Path, name: str) -> list[dict]:
    return pq.read_table(out / f"{name}.parquet").to_pylist()


# ----------------------------------------------------------------------------- each layout
EXPECTED = {  # set: (registry name, rows kept, media_dir under the set's raw, first row's images)
    "ultrachat": ("ultrachat_200k", 2, None, None),
    "alpaca": ("alpaca_en", 2, None, None),
    "llava150k": ("llava_instruct_150k", 2, "coco/train2017", ["000000033471.jpg"]),
    "llava665k": ("llava_v1_5_mix665k", 7, ".", []),
    "sharegpt4o": ("sharegpt4o", 4, SHAREGPT4O_IMAGES, ["sa_0.jpg"]),
}


@pytest.fixture(scope="module")
def outs(raw, tmp_path_factory):
    """Each set prepared once, alone, by the real command: key -> (out folder, its run)."""
    done = {}
    for key in EXPECTED:
        out = tmp_path_factory.mktemp(key)
        done[key] = (out, prepare(key, "--raw", raw / key, "--out", out))
    return done


@pytest.mark.parametrize("key", list(EXPECTED))
def test_each_published_layout_becomes_llamafactory_rows(raw, outs, key):
    name, n_rows, media, first_images = EXPECTED[key]
    out, proc = outs[key]
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out, name)
    assert len(rows) == n_rows
    assert all(formats.problem(r) is None for r in rows)
    info = json.loads((out / "dataset_info.json").read_text())
    assert info == {name: registry.entry(f"{name}.parquet", media is not None)}
    assert "estimate: UTF-8 bytes / 4" in proc.stdout  # no --tokenizer: said plainly
    assert f"dataset={name} dataset_dir={out}" in proc.stdout
    stats = json.loads((out / "prepare_stats.json").read_text())
    assert stats["datasets"][name]["samples"] == n_rows
    if media is None:
        assert "media_dir" not in proc.stdout and "images" not in rows[0]
    else:
        media_dir = os.path.normpath(raw / key / media)
        assert f"media_dir={media_dir}" in proc.stdout
        assert rows[0]["images"] == first_images
        assert all((Path(media_dir) / p).is_file() for r in rows for p in r["images"])
        assert stats["datasets"][name]["vision_token_share"] > 0
    assert not list(out.glob(".*partial*"))  # the scratch files are gone


def test_what_each_converter_keeps(raw, outs, tmp_path):
    ultrachat = rows_of(outs["ultrachat"][0], "ultrachat_200k")  # train_sft only; unanswered row out
    assert [r["id"] for r in ultrachat] == ["u0", "u1"] and len(ultrachat[1]["messages"]) == 4
    llava = rows_of(outs["llava665k"][0], "llava_v1_5_mix665k")
    assert [r["id"] for r in llava] == ["t0", "97", "n1", "o1", "x1", "v1", "v2"]
    assert llava[0]["images"] == [] and llava[2]["images"] == ["gqa/images/n1.jpg"]
    assert llava[1]["messages"] == [{"role": "user", "content": "<image>\nWhat is it?"},
                                    {"role": "assistant", "content": "A cat."}]
    sg = rows_of(outs["sharegpt4o"][0], "sharegpt4o")  # the row without <image> got one in front
    assert sg[0]["messages"][0]["content"] == "<image>\nDescribe the image in detail."
    alpaca = rows_of(outs["alpaca"][0], "alpaca_en")
    assert alpaca[1]["messages"][0] == {"role": "user", "content": "Translate\nHallo"}
    # a second set prepared into the same folder joins its registry
    shared = tmp_path / "shared"
    shutil.copytree(outs["llava665k"][0], shared)
    assert prepare("alpaca", "--raw", raw / "alpaca", "--out", shared).returncode == 0
    assert set(json.loads((shared / "dataset_info.json").read_text())) == {"llava_v1_5_mix665k", "alpaca_en"}
    assert set(json.loads((shared / "prepare_stats.json").read_text())["datasets"]) == \
        {"llava_v1_5_mix665k", "alpaca_en"}
    proc = prepare("sharegpt4o", "--raw", raw / "sharegpt4o", "--out", shared)  # its own media_dir
    assert proc.returncode == 0 and "Note: llava_v1_5_mix665k in " in proc.stdout


def test_rows_llamafactory_would_refuse_are_counted_and_named(outs):
    assert ("left out 1 row(s) LLaMA-Factory would skip or stop on: 2 <image> placeholder(s) for "
            "0 image(s) (e.g. llava_v1_5_mix665k.json record 7)") in outs["llava665k"][1].stdout
    assert ("left out 1 row(s) LLaMA-Factory would skip or stop on: last user turn has no reply "
            "(e.g. data/train_sft-00000-of-00001-0a1b2c.parquet record 2)") in outs["ultrachat"][1].stdout


# ----------------------------------------------------------------------------- MM-Mix + LF loader
@pytest.fixture(scope="module")
def lf():
    pytest.importorskip("llamafactory")
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    def load(config):
        model_args, data_args, training_args, _, _ = get_train_args(config)
        module = load_tokenizer(model_args)
        template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
        return get_dataset(template, model_args, data_args, training_args, "sft", **module)["train_dataset"]
    return load


def test_mmmix_loads_in_llamafactory_with_the_counted_tokens(raw, tmp_path, tiny_model, lf):
    from tests.helpers.lf_runs import base_yaml
    out = tmp_path / "mix"
    proc = prepare("mmmix", "--raw", raw, "--out", out, "--tokenizer", tiny_model,
                   "--image-max-pixels", MAX_PIXELS, "--cutoff-len", 100000)
    assert proc.returncode == 0, proc.stderr
    assert "MM-Mix stand-in" in proc.stdout and f"tokenizer {tiny_model}" in proc.stdout
    media_dir = str(raw)  # the deepest folder holding both image roots
    assert f"media_dir={media_dir}" in proc.stdout
    assert rows_of(out, "llava_instruct_150k")[0]["images"] == ["llava150k/coco/train2017/000000033471.jpg"]

    fragment = yaml.safe_load((out / "mm_mix.yaml").read_text())
    recipe_part = yaml.safe_load((REPO / "recipes/parts/data/mm_mix.yaml").read_text())
    for key in ("dataset", "mix_strategy", "interleave_probs"):
        assert str(fragment[key]) == str(recipe_part[key]), key
    assert fragment["dataset_dir"] == str(out) and fragment["media_dir"] == media_dir

    stats = json.loads((out / "prepare_stats.json").read_text())["datasets"]
    common = {"media_dir": media_dir, "image_max_pixels": MAX_PIXELS, "cutoff_len": 100000}
    for name in ("alpaca_en", "llava_instruct_150k", "ultrachat_200k", "sharegpt4o"):
        data = lf(base_yaml(tiny_model, out, tmp_path / "run", dataset=name, **common))
        built = sum(len(row["input_ids"]) for row in data)
        assert len(data) == stats[name]["samples"], name
        assert built == round(stats[name]["mean_tokens"] * stats[name]["samples"]), name
    mixed = lf(base_yaml(tiny_model, out, tmp_path / "run", **common,
                         **{k: recipe_part[k] for k in ("dataset", "mix_strategy", "interleave_probs")}))
    assert len(mixed) > 0


def test_llava665k_loads_in_llamafactory(raw, outs, tmp_path, tiny_model, lf):
    from tests.helpers.lf_runs import base_yaml
    out = outs["llava665k"][0]
    data = lf(base_yaml(tiny_model, out, tmp_path / "run", dataset="llava_v1_5_mix665k",
                        media_dir=str(raw / "llava665k"), image_max_pixels=MAX_PIXELS))
    assert len(data) == 7


# ----------------------------------------------------------------------------- failures
def test_missing_and_broken_images_stop_it_naming_the_rows(raw, tmp_path):
    copy = tmp_path / "sharegpt4o"
    shutil.copytree(raw / "sharegpt4o", copy)
    images = copy / SHAREGPT4O_IMAGES
    (images / "sa_1.jpg").unlink()
    (images / "sa_3.jpg").write_bytes(b"not an image at all")
    (images / "sa_2.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)  # a JPEG signature, no header
    out = tmp_path / "out"
    proc = prepare("sharegpt4o", "--raw", copy, "--out", out)
    assert proc.returncode == 1
    assert "3 row(s) name 3 image file(s) that cannot be used (4 files checked" in proc.stderr
    assert (f"  sharegpt4o, image_conversations/gpt-4o.jsonl line 2: image {images / 'sa_1.jpg'} "
            "does not exist\n") in proc.stderr
    assert (f"  sharegpt4o, image_conversations/gpt-4o.jsonl line 4: image {images / 'sa_3.jpg'} "
            "cannot be read (UnidentifiedImageError") in proc.stderr
    assert (f"  sharegpt4o, image_conversations/gpt-4o.jsonl line 3: image {images / 'sa_2.jpg'} "
            "has no readable image header (") in proc.stderr
    assert "--drop-missing" in proc.stderr and not (out / "dataset_info.json").exists()
    assert not list(out.glob("*.parquet"))

    proc = prepare("sharegpt4o", "--raw", copy, "--out", out, "--drop-missing")
    assert proc.returncode == 0, proc.stderr
    assert "left out 3 row(s) naming unusable images (--drop-missing)" in proc.stdout
    assert [r["images"] for r in rows_of(out, "sharegpt4o")] == [["sa_0.jpg"]]


def test_a_wrong_raw_folder_names_the_expected_files(raw, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = prepare("ultrachat", "--raw", empty, "--out", tmp_path / "out")
    assert proc.returncode == 1
    assert f"expected {empty}/data/train_sft-*.parquet, found nothing" in proc.stderr
    assert "hf download HuggingFaceH4/ultrachat_200k" in proc.stderr
    proc = prepare("llava150k", "--raw", raw / "llava665k", "--out", tmp_path / "out")
    assert f"expected {raw / 'llava665k'}/llava_instruct_150k.json" in proc.stderr
    proc = prepare("mmmix", "--raw", empty, "--out", tmp_path / "out")  # every member named
    for member, pattern in (("alpaca", "data/train-*.parquet"), ("llava150k", "llava_instruct_150k.json"),
                            ("ultrachat", "data/train_sft-*.parquet"),
                            ("sharegpt4o", "image_conversations/gpt-4o.jsonl")):
        assert f"{empty / member} is not a folder" in proc.stderr or \
            f"{empty / member}/{pattern}" in proc.stderr, member
    no_images = tmp_path / "no_images"
    (no_images / "image_conversations").mkdir(parents=True)
    shutil.copy(raw / "sharegpt4o/image_conversations/gpt-4o.jsonl", no_images / "image_conversations")
    proc = prepare("sharegpt4o", "--raw", no_images, "--out", tmp_path / "out")
    assert f"expected the images under {no_images / SHAREGPT4O_IMAGES}" in proc.stderr
    assert "unzip" in proc.stderr
    proc = prepare("ultrachat", "--raw", raw / "ultrachat", "--out", tmp_path / "out", "--image-root", raw)
    assert proc.returncode == 1 and "UltraChat-200K has no images" in proc.stderr


# ----------------------------------------------------------------------------- pure parts
def test_problem_names_what_llamafactory_refuses():
    user, bot = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    assert formats.problem({"messages": [user, bot]}) is None
    assert formats.problem({"messages": [{"role": "system", "content": "s"}, user, bot]}) is None
    assert formats.problem({"messages": []}) == "no messages"
    assert formats.problem({"messages": [bot, user]}) == "turns do not alternate user/assistant"
    assert formats.problem({"messages": [user, bot, user]}) == "last user turn has no reply"
    assert formats.problem({"messages": [{"role": "tool", "content": "x"}, bot]}) == "unknown role 'tool'"
    assert formats.problem({"messages": [user, {"role": "system", "content": "s"}, bot]}) == \
        "a system turn after the first turn"
    assert formats.problem({"messages": [{"role": "user", "content": None}, bot]}) == "a turn without text"
    img = {"role": "user", "content": "<image> q"}
    assert formats.problem({"messages": [img, bot], "images": ["a.jpg"]}) is None
    assert formats.problem({"messages": [img, bot], "images": []}) == "1 <image> placeholder(s) for 0 image(s)"
    assert formats.problem({"messages": [{"role": "user", "content": "<video>"}, bot]}).startswith("<video>")


def test_streamed_json_list_equals_json_load(tmp_path):
    items = [{"id": i, "text": "x" * (i * 37 % 500), "n": [1.5, None, True]} for i in range(300)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(items, indent=1))
    assert list(layouts._json_array(str(path), chunk=64)) == items
    (tmp_path / "b.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        list(layouts._json_array(str(tmp_path / "b.json")))


def test_bench_counts_with_the_package_rule():
    from bench import workloads
    from odb_factory import token_lengths
    assert workloads.image_patches is token_lengths.image_patches
    assert workloads.length_cv is token_lengths.length_cv
    assert [registry.MIXTURE_KEYS[k] for k in ("mix_strategy", "interleave_probs")] == \
        ["interleave_under", "0.4,0.3,0.2,0.1"]
