"""Run real LLaMA-Factory training jobs on the tiny Qwen3-VL for the end-to-end tests.

`train()` runs the command `llamafactory-cli train` itself runs (odb_factory.llamafactory.launch:
`torchrun ... llamafactory/launcher.py CONFIG` with more than one process), which saves the CLI's
own ~8 s of imports per run; `via_cli=True` goes through `llamafactory-cli`, for the tests whose
point is the user's entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from odb_factory.llamafactory import launch
from odb_factory.llamafactory.audit_ledger import read_ledger

REPO = Path(__file__).resolve().parents[2]
# the shared demo data beside the checkout (a mutation run's copy of the tests sits deeper in it)
SHARED_DEMO = next((d / "shared" / "data" / "llamafactory_demo" for d in REPO.parents
                    if (d / "shared" / "data" / "llamafactory_demo").is_dir()),
                   REPO.parent / "shared" / "data" / "llamafactory_demo")
BIN = Path(sys.executable).parent
NUM_SAMPLES = 96  # tests/conftest.py's demo_data

# groups mode: the end-to-end tests of the paper's batching (coverage ledgers, exact global token mean)
GROUPS_ODB = {"odb_enable": True, "odb_step": "groups", "odb_loss_scaling": "exact", "odb_token_budget": 768,
              "odb_buffer_size": 32, "odb_collate_workers": 1}


def lazy_and_eager(lf, config: dict, data_stage: str = "sft"):
    """The training split of `config` for LLaMA-Factory's data stage `data_stage`, built twice in
    this process: with ODB (the lazy dataset) and without it (upstream's eager datasets.map).
    `lf`: the tests' fixture of LLaMA-Factory's patched entry points."""
    from odb_factory.llamafactory.run import attach
    get_train_args, load_tokenizer, get_template, get_dataset = lf
    model_args, data_args, training_args, _, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template(tokenizer_module["tokenizer"], data_args)
    lazy = get_dataset(template, model_args, data_args, training_args, data_stage, **tokenizer_module)["train_dataset"]
    attach(None, data_args)  # the same run without ODB
    eager = get_dataset(template, model_args, data_args, training_args, data_stage, **tokenizer_module)["train_dataset"]
    return lazy, eager


def env(**extra: str) -> Dict[str, str]:
    out = dict(os.environ)
    out.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PATH=f"{BIN}{os.pathsep}{out.get('PATH', '')}",
               DISABLE_VERSION_CHECK="1")
    out.pop("ODB_FACTORY_DISABLE", None)
    out.update(extra)
    return out


def base_yaml(model_dir: Path, data_dir: Path, out_dir: Path, **overrides) -> dict:
    config = {
        "model_name_or_path": str(model_dir), "image_max_pixels": 65536, "image_min_pixels": 1024,
        "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "odb_demo", "dataset_dir": str(data_dir), "template": "qwen3_vl_nothink",
        "cutoff_len": 1024, "overwrite_cache": True, "preprocessing_num_workers": 1,
        "dataloader_num_workers": 1, "output_dir": str(out_dir), "logging_steps": 1,
        "save_strategy": "no", "overwrite_output_dir": True, "report_to": "none", "plot_loss": False,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-3,
        "num_train_epochs": 1, "lr_scheduler_type": "cosine", "bf16": False, "seed": 7,
    }
    config.update(overrides)
    return config


def train_command(path: Path, nproc: int = 1, via_cli: bool = False) -> List[str]:
    """The command that trains `path` on `nproc` local processes (see the module docstring)."""
    if via_cli:
        return [str(BIN / "llamafactory-cli"), "train", str(path)]
    return launch.train_command([path], nproc)


def train(config: dict, nproc: int = 1, timeout: float = 600, check: bool = True, via_cli: bool = False,
          **env_extra: str) -> subprocess.CompletedProcess:
    out_dir = Path(config["output_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir.parent / f"{out_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    extra = dict(env_extra)
    if nproc > 1:
        extra.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(nproc))
    for _ in range(3):
        proc = subprocess.run(train_command(path, nproc, via_cli), env=env(**extra),
                              capture_output=True, text=True, timeout=timeout, cwd=str(out_dir.parent))
        # torchrun binds the rendezvous port a moment after it was found free; another test's
        # process can take it in between. Only that failure is retried, with a new port.
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    (out_dir.parent / f"{out_dir.name}.log").write_text(proc.stdout + proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def odb_run(tmp_path: Path, model_dir: Path, data_dir: Path, name: str, nproc: int = 1, **overrides):
    """A groups-mode ODB training under tmp_path/name, with its audit ledger: (output dir, rows)."""
    out = tmp_path / name
    config = base_yaml(model_dir, data_dir, out, odb_audit_dir=str(tmp_path / f"{name}_audit"),
                       **{**GROUPS_ODB, **overrides})
    train(config, nproc=nproc)
    return out, ledger(tmp_path / f"{name}_audit")


def ledger(audit_dir: Path, max_step: Optional[int] = None) -> List[dict]:
    return read_ledger(str(audit_dir), max_step)


def trained_indices(rows: List[dict]) -> List[int]:
    return sorted(i for r in rows for i in r["indices"])


def log_history(out_dir: Path) -> List[dict]:
    return json.loads((Path(out_dir) / "trainer_state.json").read_text())["log_history"]


def assert_trains_the_standard_model(standard: Path, odb: Path, rel: float) -> List[tuple]:
    """The ODB run logged Standard's optimizer steps (more than 5), each loss within `rel`
    relative, each learning rate within 1e-9, and its eval loss within `rel`; returns the
    logged (Standard, ODB) step pairs."""
    import pytest
    std_steps = [h for h in log_history(standard) if "loss" in h]
    odb_steps = [h for h in log_history(odb) if "loss" in h]
    assert [h["step"] for h in odb_steps] == [h["step"] for h in std_steps] and len(std_steps) > 5
    for a, b in zip(std_steps, odb_steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), (a["step"], a["loss"], b["loss"])
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-9)
    std_eval, odb_eval = (json.loads((out / "eval_results.json").read_text())["eval_loss"] for out in (standard, odb))
    assert odb_eval == pytest.approx(std_eval, rel=rel)
    return list(zip(std_steps, odb_steps))


def balance_stages() -> List[str]:
    """Both balancing stages where the installed transformers has the vision stage, else the
    LLM stage alone (elsewhere the vision stage is refused at parse time: test_version_matrix)."""
    import transformers
    from odb_factory.versions import encoder_stage_supported
    return ["llm", "vision"] if encoder_stage_supported(transformers.__version__) else ["llm"]
