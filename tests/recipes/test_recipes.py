"""The recipes under recipes/: in sync with their parts, accepted by LLaMA-Factory's own
argument parser (with the odb_* patch in place), and refusing the mistakes users make.

Nothing trains here. Every flat recipe goes through `llamafactory.hparams.get_train_args`,
the function `llamafactory-cli train` calls, in this process and on CPU. What the parse
changes in a recipe, and nothing else (see `cpu_parse_view`):

* `bf16: true` -> false: HF's TrainingArguments refuses bf16 on a machine without a bf16
  GPU ("Your setup doesn't support bf16/gpu") unless `use_cpu` is set, which we must not add
  (it breaks ZeRO-3 on CPU). Precision does not interact with any other key that is checked.
* `deepspeed` is removed for the parse and the config file is checked on its own
  (`check_deepspeed_config`): with it, get_train_args insists on a torchrun launch
  ("Please use FORCE_TORCHRUN=1") and TrainingArguments would initialise a process group
  in the test process (and JIT-build DeepSpeed's CPU comm op, ~110 s on a fresh machine).
  The file is instead filled by HF's own `HfTrainerDeepSpeedConfig` from the parsed
  arguments and a real Qwen3-VL config, then validated by DeepSpeed's `DeepSpeedConfig`
  (its pydantic models reject unknown ZeRO keys).

Paths are not overridden. The parse runs in a scratch copy of the repository layout
(`workspace`): the tiny model and demo data built where `make demo` puts them
(`.cache/tiny_qwen3vl`, `.cache/odb_demo_data`) and `recipes/` linked in, so relative paths in
the recipes resolve exactly as from the repository root. Hub model ids
(`Qwen/Qwen3-VL-8B-Instruct`) need nothing local: the parser never opens the model. The
odb_* keys are passed as written, so a misspelt odb key in a recipe fails here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `recipes` is a top-level folder of the repository
    sys.path.insert(0, str(REPO))

from recipes import compose

FLAT = sorted(compose.RECIPES)
DS_CONFIGS = sorted(p.name for p in (compose.PARTS_DIR / "deepspeed").glob("*.json"))
TINY_ODB = "tiny/qwen3vl_tiny_odb.yaml"


def load_recipe(name: str) -> dict:
    """The recipe as LLaMA-Factory reads it (parser.read_args does the same)."""
    return OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / name))


def cpu_parse_view(raw: dict) -> tuple[dict, str | None]:
    """The two changes this CPU-only parse needs (module docstring): bf16 off, deepspeed
    taken out (returned, to be checked separately). Everything else is passed as written."""
    args = dict(raw)
    if args.get("bf16"):
        args["bf16"] = False
    return args, args.pop("deepspeed", None)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def lf():
    """LLaMA-Factory with our patches applied, as in `llamafactory-cli train`: the import hook
    patches on `import llamafactory.train.tuner`; apply() is explicit too (idempotent) so the
    test does not depend on the .pth hook being installed."""
    pytest.importorskip("llamafactory")
    import llamafactory.train.tuner  # noqa: F401
    import odb_factory_patches
    from llamafactory.hparams import get_train_args, parser

    odb_factory_patches.apply()
    assert getattr(parser._parse_train_args, "_odb_wrapped", False), "odb_* parser patch not applied"
    return SimpleNamespace(get_train_args=get_train_args, read_args=parser.read_args)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl

    root = tmp_path_factory.mktemp("recipes_ws")
    build_tiny_qwen3vl(root / ".cache" / "tiny_qwen3vl")
    write_demo_dataset(root / ".cache" / "odb_demo_data", num_samples=8)
    (root / "recipes").symlink_to(REPO / "recipes", target_is_directory=True)
    return root


def odb_options(parsed):
    """The odb options the parser patch handed on with LLaMA-Factory's arguments (None: none)."""
    from odb_factory.llamafactory.run import run_of
    run = run_of(parsed[1], enabled_only=False)
    return run.options if run is not None else None


# ------------------------------------------------------------------ (a) composition
def test_flat_recipes_are_exactly_their_composition():
    problems = compose.stale()
    assert not problems, ("flat recipes out of sync with recipes/parts; run `python -m recipes.compose`:\n  "
                          + "\n  ".join(problems))


@pytest.mark.parametrize("name", FLAT)
def test_flat_file_loads_back_to_the_merged_parts(name):
    # Guards the writer: the YAML text must read back (via OmegaConf, as LLaMA-Factory reads
    # it) to the same keys, values and types the parts merge to.
    assert load_recipe(name) == compose.compose(compose.RECIPES[name])


def test_composition_order_later_part_wins():
    merged = compose.compose(compose.RECIPES[TINY_ODB])
    assert merged["bf16"] is False and merged["cutoff_len"] == 2048  # base/tiny_cpu over base/sft_full
    assert merged["odb_collate_workers"] == 1  # the recipe's own keys come last
    nonjoin = compose.compose(compose.RECIPES["qwen3vl_8b_odb_nonjoin.yaml"])
    assert nonjoin["odb_join"] is False and nonjoin["odb_enable"] is True


def test_unknown_part_is_named():
    with pytest.raises(FileNotFoundError, match="method/odb_jion"):
        compose.compose(compose.Recipe("typo", ("base/sft_full", "method/odb_jion")))


# ------------------------------------------- (b) every recipe through LLaMA-Factory's parser
@pytest.mark.parametrize("name", FLAT)
def test_recipe_parses_with_llamafactory(name, lf, workspace, monkeypatch):
    import transformers
    from llamafactory.data.parser import get_dataset_list
    from llamafactory.data.template import TEMPLATES

    from odb_factory.llamafactory.arguments import FLASH_ATTENTION_BROKEN
    monkeypatch.chdir(workspace)
    raw = load_recipe(name)
    assert "use_cpu" not in raw, "use_cpu breaks ZeRO-3 on CPU (DESIGN.md §3); leave it unset"
    args, deepspeed = cpu_parse_view(raw)
    if args.get("flash_attn") in ("fa2", "fa3") and transformers.__version__ in FLASH_ATTENTION_BROKEN:
        # the recipe's header names the transformers it needs; this one is refused, by name
        assert "transformers 4.57.6" in (REPO / "recipes" / name).read_text()
        with pytest.raises(ValueError, match=rf"flash_attn: {args['flash_attn']}: transformers "
                                             rf"{transformers.__version__}'s flash attention fails"):
            lf.get_train_args(args)
        args["flash_attn"] = "sdpa"
    parsed = lf.get_train_args(args)
    model_args, data_args, training_args, finetuning_args, _ = parsed

    assert finetuning_args.stage == "sft" and finetuning_args.finetuning_type == "full"
    assert model_args.model_name_or_path == raw["model_name_or_path"]
    assert data_args.template in TEMPLATES, f"unknown template {data_args.template}"
    # (LLaMA-Factory keeps one token of the cutoff back when packing.)
    assert data_args.cutoff_len == raw["cutoff_len"] - int(bool(raw.get("packing")))
    # Every dataset name resolves through LLaMA-Factory's own dataset_info reader.
    assert len(get_dataset_list(data_args.dataset, data_args.dataset_dir)) == len(data_args.dataset) > 0

    odb_keys = {k: v for k, v in raw.items() if k.startswith("odb_")}
    odb = odb_options(parsed)
    if odb_keys:
        assert odb is not None, "odb_* keys present but the patch recorded no options"
        for key, value in odb_keys.items():
            assert odb.value_of(key) == value, key
        assert not data_args.packing
    else:
        assert odb is None
    if raw.get("packing"):
        assert data_args.packing and not odb_keys
    if deepspeed is not None:
        check_deepspeed_config(Path(deepspeed), training_args, workspace)


def check_deepspeed_config(path: Path, training_args, workspace: Path) -> None:
    """What HF + DeepSpeed do with the file at start-up, minus the process group: fill the
    "auto" values from the arguments and the model config, then DeepSpeed's own validation."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    assert path.is_file(), f"deepspeed: {path} does not exist (paths are relative to the repository root)"
    config = json.loads(path.read_text())
    assert config.get("zero_allow_untested_optimizer") is True
    model = SimpleNamespace(config=AutoConfig.from_pretrained(workspace / ".cache" / "tiny_qwen3vl"))
    hf_config = HfTrainerDeepSpeedConfig(config)
    try:
        hf_config.trainer_config_process(training_args)
        hf_config.trainer_config_finalize(training_args, model, num_training_steps=10)  # raises on mismatches
        filled = hf_config.config
    finally:
        unset_hf_deepspeed_config()
    assert "auto" not in json.dumps(filled), filled
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == config["zero_optimization"]["stage"]
    assert ds.train_batch_size == training_args.per_device_train_batch_size * \
        training_args.gradient_accumulation_steps  # world size 1 here


@pytest.mark.parametrize("ds_file", DS_CONFIGS)
def test_every_deepspeed_config_validates(ds_file, lf, workspace, monkeypatch):
    # ds_z3.json is used by no flat recipe (users pass deepspeed=...ds_z3.json); check it too.
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe(TINY_ODB))
    _, _, training_args, _, _ = lf.get_train_args(args)
    check_deepspeed_config(Path("recipes/parts/deepspeed") / ds_file, training_args, workspace)


def test_command_line_overrides_reach_the_odb_options(lf, workspace, monkeypatch):
    # `llamafactory-cli train recipes/qwen3vl_8b_odb.yaml odb_token_budget=8192 odb_join=false`
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "argv", ["llamafactory-cli", "recipes/qwen3vl_8b_odb.yaml",
                                      "odb_token_budget=8192", "odb_join=false"])
    args, _ = cpu_parse_view(lf.read_args())
    odb = odb_options(lf.get_train_args(args))
    assert odb.config.token_budget == 8192
    assert odb.config.join is False


@pytest.mark.parametrize("key,value,expected", [
    ("odb_enable", "ture", "odb_enable: 'ture' is not a boolean"),
    ("odb_token_budget", "4k", "odb_token_budget: '4k' is not an integer"),
    ("odb_collate_workers", "two", "odb_collate_workers: 'two' is not an integer"),
])
def test_badly_typed_odb_values_are_named_before_training(lf, workspace, monkeypatch, key, value, expected):
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe(TINY_ODB))
    args[key] = value
    with pytest.raises(ValueError, match=expected):
        lf.get_train_args(args)


def test_string_booleans_are_typed_not_truthy(lf, workspace, monkeypatch):
    # YAML `odb_join: "false"` (a string) must turn join off, not count as a non-empty string
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe(TINY_ODB))
    args.update(odb_join="false", odb_token_budget="2048")
    odb = odb_options(lf.get_train_args(args))
    assert odb.config.join is False
    assert odb.config.token_budget == 2048


# ----------------------------------------------------------------- (c) refused recipes
def test_misspelt_odb_key_names_the_right_one(lf, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe("qwen3vl_8b_odb.yaml"))
    args["odb_token_budgte"] = args.pop("odb_token_budget")
    with pytest.raises(ValueError, match="did you mean 'odb_token_budget'"):
        lf.get_train_args(args)


def test_odb_keys_with_a_non_sft_stage_are_refused(lf, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe(TINY_ODB))
    args["stage"] = "kto"
    with pytest.raises(ValueError, match=r"odb_enable: true applies to stage \['sft', 'pt', 'dpo'\]; this run has stage 'kto'"):
        lf.get_train_args(args)


def test_packing_with_odb_is_refused_with_the_reason(lf, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    args, _ = cpu_parse_view(load_recipe(TINY_ODB))
    args["packing"] = True
    with pytest.raises(ValueError, match="packing/neat_packing: ODB forms token-budgeted groups itself.*"
                                         "odb_padding_free: true to train each group without padding"):
        lf.get_train_args(args)


# ------------------------------------------------------------------ (d) outside a checkout
def test_a_written_recipe_runs_from_anywhere(lf, tmp_path, monkeypatch):
    """`python -m odb_factory.recipes write` (what an installed package offers): the recipe
    and the files it names land in one folder, and LLaMA-Factory parses it from elsewhere."""
    import subprocess

    from llamafactory.data.parser import get_dataset_list
    out = tmp_path / "my_run"
    done = subprocess.run([sys.executable, "-m", "odb_factory.recipes", "write", "qwen3vl_8b_odb_balance",
                           "--out", str(out)], capture_output=True, text=True, check=True)
    assert f"wrote {out / 'qwen3vl_8b_odb_balance.yaml'}" in done.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    raw = OmegaConf.to_container(OmegaConf.load(out / "qwen3vl_8b_odb_balance.yaml"))
    assert raw["deepspeed"] == str(out / "deepspeed" / "ds_z2.json") and Path(raw["deepspeed"]).is_file()
    args, _ = cpu_parse_view(raw)
    parsed = lf.get_train_args(args)
    data_args = parsed[1]
    assert data_args.dataset_dir == str(out / "data")
    assert len(get_dataset_list(data_args.dataset, data_args.dataset_dir)) == 1
    assert odb_options(parsed).value_of("odb_balance") is True
    bad = subprocess.run([sys.executable, "-m", "odb_factory.recipes", "write", "qwen3vl_8b_odbb"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no recipe named 'qwen3vl_8b_odbb'; choose one of: " in bad.stderr


def test_a_built_package_ships_the_recipes(tmp_path):
    """setup.py copies the flat recipes and the files they name into the package."""
    import subprocess
    subprocess.run([sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path)],
                   cwd=REPO, capture_output=True, text=True, check=True)
    shipped = tmp_path / "lib" / "odb_factory" / "recipes_data"
    code = ("import sys; from pathlib import Path; from odb_factory import recipes; "
            f"print(recipes.names(Path({str(shipped)!r})))")
    listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert eval(listed.stdout) == sorted(n[:-len(".yaml")] for n in compose.RECIPES)
    assert (shipped / "parts" / "deepspeed" / "ds_z3.json").is_file()
    assert (shipped / "data" / "dataset_info.json").is_file()
