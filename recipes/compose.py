"""Write the flat LLaMA-Factory recipes of recipes/ from the small parts in recipes/parts/.

LLaMA-Factory reads one flat YAML file per run, so the flat files are generated and
committed; tests/recipes/test_recipes.py checks they are exactly what this script produces.
To change a recipe, edit a part (or the table below) and run, from the repository root:

    python -m recipes.compose            # rewrite every flat recipe
    python -m recipes.compose --check    # list stale or unknown flat files, exit 1 if any

A recipe is a list of parts merged in order with OmegaConf (a later part wins, key by key),
then its own ``set`` keys. A part is ``group/name`` for ``parts/group/name.yaml``, or
``deepspeed/<file>.json``, which adds ``deepspeed: recipes/parts/deepspeed/<file>.json``.
In the written file every key sits under the part that set it last.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

RECIPES_DIR = Path(__file__).resolve().parent
PARTS_DIR = RECIPES_DIR / "parts"
# Paths inside the recipes are relative to the repository root (run llamafactory-cli there).
PARTS_FROM_REPO = "recipes/parts"

CLUSTER_8 = "llamafactory-cli train {path}    # one node, all 8 GPUs (LLaMA-Factory starts torchrun)"
CLUSTER_2x8 = ("NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0> MASTER_PORT=29500 "
               "llamafactory-cli train {path}    # on each of 2 nodes x 8 GPUs")
CPU_1 = "llamafactory-cli train {path}    # one CPU process"
CPU_2 = "FORCE_TORCHRUN=1 NPROC_PER_NODE=2 llamafactory-cli train {path}    # 2 CPU ranks, gloo"


# What a recipe needs before its launch line works, by the parts it uses (the header lists it).
_PREPARE = ("python -m odb_factory.data prepare {set} --raw <download> --out <data>, then add "
            "dataset_dir=<data> media_dir=<the folder it prints> to the launch line")
NEEDS: dict[str, str] = {
    "model/qwen3vl_8b": "Qwen/Qwen3-VL-8B-Instruct (from the Hub, or model_name_or_path=<a local copy>)",
    "model/qwen3vl_2b": "Qwen/Qwen3-VL-2B-Instruct (from the Hub, or model_name_or_path=<a local copy>)",
    "model/qwen3vl_tiny": "the tiny model and data that make demo builds into .cache/",
    "data/sharegpt4o": "ShareGPT-4o images: " + _PREPARE.format(set="sharegpt4o"),
    "data/llava_instruct_150k": "LLaVA-Instruct-150K with COCO train2017: " + _PREPARE.format(set="llava150k"),
    "data/ultrachat_200k": ("UltraChat-200K: read from the Hub as registered, or offline: "
                            + _PREPARE.format(set="ultrachat").split(", then")[0] + ", then dataset_dir=<data>"),
    "method/odb_padding_free": ("flash-attn 2 with transformers 4.57.6 (5.6.0's flash-attention path fails): "
                                "pip install -r constraints-transformers-4.57.txt flash-attn"),
    "model/qwen25omni_7b": "Qwen/Qwen2.5-Omni-7B (from the Hub, or model_name_or_path=<a local copy>)",
    "data/omni_speech": ("speech data with an `audios` column in <data>/omni_speech.json (rows as "
                         "recipes/data/dataset_info.json's omni_speech entry reads them), then add "
                         "dataset_dir=<data> to the launch line"),
    "data/mm_mix": "MM-Mix stand-in (Alpaca, LLaVA, UltraChat, ShareGPT-4o): " + _PREPARE.format(set="mmmix"),
}
GPUS = {CLUSTER_8: "1 node x 8 GPUs (the paper: 96 GB H20s; lower odb_token_budget on smaller GPUs)",
        CLUSTER_2x8: "2 nodes x 8 GPUs (the paper: 96 GB H20s)", CPU_1: "a CPU", CPU_2: "a CPU (2 processes)"}


@dataclass(frozen=True)
class Recipe:
    about: str
    parts: tuple[str, ...]
    set: Mapping[str, Any] = field(default_factory=dict)
    run: str = CLUSTER_8

    def needs(self) -> list[str]:
        return [GPUS[self.run]] + [NEEDS[p] for p in self.parts if p in NEEDS]


_8B = ("base/sft_full", "model/qwen3vl_8b")
_TINY = ("base/sft_full", "model/qwen3vl_tiny", "data/odb_demo", "base/tiny_cpu")
_TINY_ODB = {"odb_token_budget": 1024, "odb_buffer_size": 64, "odb_collate_workers": 1}

# The paper's budgets: 12288 tokens for UltraChat, 14336 for ShareGPT-4o. LLaVA and MM-Mix
# budgets are not given there; 12288 and 14336 are our choices.
RECIPES: dict[str, Recipe] = {
    "qwen3vl_8b_odb.yaml": Recipe(
        "Qwen3-VL-8B full SFT on ShareGPT-4o with ODB (join), ZeRO-2, bf16: the paper's setup.",
        _8B + ("data/sharegpt4o", "method/odb_join", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen3vl_8b_odb"}),
    "qwen3vl_8b_odb_samples.yaml": Recipe(
        "Qwen3-VL-8B full SFT on ShareGPT-4o with ODB keeping the fixed-batch optimizer steps "
        "(batch 1 x accumulation 8 per GPU, the same model as Standard), ZeRO-2, bf16.",
        _8B + ("data/sharegpt4o", "method/odb_samples", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen3vl_8b_odb_samples"}),
    "qwen3vl_8b_odb_padding_free.yaml": Recipe(
        "As qwen3vl_8b_odb_samples (the same model as Standard), each step's groups formed over every "
        "rank's samples, each group trained as one row without padding (flash attention), post-balanced.",
        _8B + ("data/sharegpt4o", "method/odb_samples", "method/odb_padding_free", "method/odb_balance",
               "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "odb_global_grouping": True, "output_dir": "runs/qwen3vl_8b_odb_padding_free"}),
    "qwen25omni_7b_odb_audio.yaml": Recipe(
        "Qwen2.5-Omni-7B (thinker) full SFT on speech data with ODB keeping the fixed-batch optimizer "
        "steps, post-balanced per stage: LLM, vision tower and audio tower; ZeRO-2, bf16.",
        ("base/sft_full", "model/qwen25omni_7b", "data/omni_speech", "method/odb_samples",
         "method/odb_balance_omni", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen25omni_7b_odb_audio"}),
    "qwen3vl_8b_odb_nonjoin.yaml": Recipe(
        "As qwen3vl_8b_odb, non-join mode (equal sample quota per rank, no idle slots).",
        _8B + ("data/sharegpt4o", "method/odb_join", "method/odb_nonjoin", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen3vl_8b_odb_nonjoin"}),
    "qwen3vl_8b_odb_balance.yaml": Recipe(
        "As qwen3vl_8b_odb, plus post-balancing of each step across ranks (LLM and vision cost).",
        _8B + ("data/sharegpt4o", "method/odb_join", "method/odb_balance", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen3vl_8b_odb_balance"}),
    "qwen3vl_8b_odb_ultrachat.yaml": Recipe(
        "Qwen3-VL-8B full SFT on UltraChat-200K (text) with ODB (join), ZeRO-2, bf16.",
        _8B + ("data/ultrachat_200k", "method/odb_join", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 12288, "output_dir": "runs/qwen3vl_8b_odb_ultrachat"}),
    "qwen3vl_8b_odb_llava.yaml": Recipe(
        "Qwen3-VL-8B full SFT on LLaVA-Instruct-150K with ODB (join), ZeRO-2, bf16.",
        _8B + ("data/llava_instruct_150k", "method/odb_join", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 12288, "output_dir": "runs/qwen3vl_8b_odb_llava"}),
    "qwen3vl_8b_standard.yaml": Recipe(
        "Baseline for qwen3vl_8b_odb: LLaMA-Factory as shipped, 1 sample per device (the paper's Standard).",
        _8B + ("data/sharegpt4o", "method/standard", "deepspeed/ds_z2.json"),
        {"output_dir": "runs/qwen3vl_8b_standard"}),
    "qwen3vl_8b_sorted.yaml": Recipe(
        "Baseline for qwen3vl_8b_odb: length-grouped batches of 4 (HF LengthGroupedSampler), the closest "
        "built-in to the paper's Sorted.",
        _8B + ("data/sharegpt4o", "method/sorted", "deepspeed/ds_z2.json"),
        {"output_dir": "runs/qwen3vl_8b_sorted"}),
    "qwen3vl_8b_packing_ultrachat.yaml": Recipe(
        "Baseline on UltraChat-200K (text only): LLaMA-Factory sequence packing, no ODB.",
        _8B + ("data/ultrachat_200k", "method/packing", "deepspeed/ds_z2.json"),
        {"output_dir": "runs/qwen3vl_8b_packing_ultrachat"}),
    "qwen3vl_2b_odb.yaml": Recipe(
        "Qwen3-VL-2B full SFT on MM-Mix (our public stand-in for the paper's mix) with ODB (join), "
        "2 nodes, ZeRO-2, bf16.",
        ("base/sft_full", "model/qwen3vl_2b", "data/mm_mix", "method/odb_join", "deepspeed/ds_z2.json"),
        {"odb_token_budget": 14336, "output_dir": "runs/qwen3vl_2b_odb"},
        run=CLUSTER_2x8),
    "tiny/qwen3vl_tiny_odb.yaml": Recipe(
        "Tiny random Qwen3-VL on the generated demo set, ODB (join), CPU.",
        _TINY + ("method/odb_join",),
        {**_TINY_ODB, "output_dir": ".cache/runs/qwen3vl_tiny_odb"}, run=CPU_1),
    "tiny/qwen3vl_tiny_odb_samples.yaml": Recipe(
        "Tiny random Qwen3-VL on the generated demo set, ODB keeping the fixed-batch steps "
        "(batch 1 x accumulation 4), CPU.",
        _TINY + ("method/odb_samples",),
        {**_TINY_ODB, "gradient_accumulation_steps": 4,
         "output_dir": ".cache/runs/qwen3vl_tiny_odb_samples"}, run=CPU_2),
    "tiny/qwen3vl_tiny_odb_nonjoin.yaml": Recipe(
        "Tiny random Qwen3-VL on the generated demo set, ODB (non-join), CPU.",
        _TINY + ("method/odb_join", "method/odb_nonjoin"),
        {**_TINY_ODB, "output_dir": ".cache/runs/qwen3vl_tiny_odb_nonjoin"}, run=CPU_2),
    "tiny/qwen3vl_tiny_standard.yaml": Recipe(
        "Tiny random Qwen3-VL on the generated demo set, LLaMA-Factory as shipped (1 sample per step), CPU.",
        _TINY + ("method/standard",),
        {"output_dir": ".cache/runs/qwen3vl_tiny_standard"}, run=CPU_1),
    "tiny/qwen3vl_tiny_odb_z2.yaml": Recipe(
        "Tiny random Qwen3-VL on the generated demo set, ODB (join) under DeepSpeed ZeRO-2, 2 CPU ranks.",
        _TINY + ("method/odb_join", "deepspeed/ds_z2.json"),
        {**_TINY_ODB, "output_dir": ".cache/runs/qwen3vl_tiny_odb_z2"}, run=CPU_2),
}


def load_part(ref: str) -> dict[str, Any]:
    """The keys one part contributes, as LLaMA-Factory would read them (OmegaConf)."""
    if ref.startswith("deepspeed/") and ref.endswith(".json"):
        if not (PARTS_DIR / ref).is_file():
            raise FileNotFoundError(f"DeepSpeed config {PARTS_DIR / ref} does not exist")
        return {"deepspeed": f"{PARTS_FROM_REPO}/{ref}"}
    path = PARTS_DIR / f"{ref}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"part '{ref}' not found: {path} does not exist")
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(loaded, dict):
        raise TypeError(f"part '{ref}' ({path}) must be a mapping of LLaMA-Factory keys")
    return loaded


def sources(recipe: Recipe) -> list[tuple[str, dict[str, Any]]]:
    """(label, keys) for every part of the recipe, then its own keys, in merge order."""
    out = [(ref, load_part(ref)) for ref in recipe.parts]
    if recipe.set:
        out.append(("recipe", dict(recipe.set)))
    return out


def compose(recipe: Recipe) -> dict[str, Any]:
    """The merged flat configuration of a recipe."""
    merged = OmegaConf.merge(*[OmegaConf.create(keys) for _, keys in sources(recipe)])
    return OmegaConf.to_container(merged, resolve=True)


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars, which read better inline ([llm, vision])."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> Any:
    flow = all(not isinstance(item, (list, dict)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _dump(key: str, value: Any) -> str:
    return yaml.dump({key: value}, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def render(name: str, recipe: Recipe) -> str:
    """The text of a flat recipe file: a header, then the keys grouped by the part that set
    them last (in merge order)."""
    srcs = sources(recipe)
    merged = compose(recipe)
    owner = {}
    for label, keys in srcs:
        for key in keys:
            owner[key] = label
    lines = [
        f"# {Path(name).stem}: {recipe.about}",
        "# Needs:",
        *[f"#   - {need}" for need in recipe.needs()],
        "# Run from the repository root (or anywhere, after `python -m odb_factory.recipes write "
        f"{Path(name).with_suffix('')} --out DIR`):",
        "#   " + recipe.run.format(path=f"recipes/{name}"),
        "# Override any key on the command line, e.g. odb_token_budget=8192 (see recipes/README.md).",
        "# Generated by `python -m recipes.compose` from recipes/parts: edit the parts or the table in",
        "# recipes/compose.py and re-run it; tests/recipes/test_recipes.py fails when this file is out of sync.",
    ]
    for label, keys in srcs:
        own = [k for k in keys if owner[k] == label]
        if not own:
            continue
        title = "recipe" if label == "recipe" else f"parts/{label}" + ("" if label.endswith(".json") else ".yaml")
        lines += ["", f"### {title}"]
        lines += [_dump(k, merged[k]).rstrip("\n") for k in own]
    return "\n".join(lines) + "\n"


def render_all() -> dict[str, str]:
    """Relative path under recipes/ -> file text, for every recipe of the table."""
    return {name: render(name, recipe) for name, recipe in RECIPES.items()}


def flat_files_on_disk() -> list[str]:
    """Every YAML file under recipes/ outside parts/ (each must come from the table)."""
    return sorted(str(p.relative_to(RECIPES_DIR)) for p in RECIPES_DIR.rglob("*.yaml")
                  if PARTS_DIR not in p.parents)


def stale() -> list[str]:
    """Flat files that differ from their composition, are missing, or are not in the table."""
    wanted = render_all()
    problems = []
    for name, text in wanted.items():
        path = RECIPES_DIR / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{name}: differs from its composition")
    for name in flat_files_on_disk():
        if name not in wanted:
            problems.append(f"{name}: not in the RECIPES table of recipes/compose.py")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for line in problems:
            print(line)
        return 1 if problems else 0
    for name, text in render_all().items():
        path = RECIPES_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote recipes/{name}")
    for name in flat_files_on_disk():
        if name not in RECIPES:
            print(f"note: recipes/{name} is not in the RECIPES table (left as is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
