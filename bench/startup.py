"""Start-up figures: the import hook's cost in processes that never use LLaMA-Factory, and
the time from launch to the first optimizer step with lazy vs eager preprocessing.

    python -m bench.startup [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .measured import LLAMAFACTORY_CLI, offline_env

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "bench"


def python_startup(runs: int) -> dict:
    """Median wall time of `python -c pass` with the hook and with ODB_FACTORY_DISABLE=1,
    interleaved so machine noise hits both alike."""
    times = {"hook": [], "disabled": []}
    for _ in range(runs):
        for name in times:
            env = dict(os.environ)
            env.pop("ODB_FACTORY_DISABLE", None)
            if name == "disabled":
                env["ODB_FACTORY_DISABLE"] = "1"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
            times[name].append(time.perf_counter() - start)
    hook, off = statistics.median(times["hook"]), statistics.median(times["disabled"])
    # The hook module's own import time, as the interpreter measures it (-X importtime):
    # wall-clock differences of a few ms are within this machine's noise.
    imports = []
    for _ in range(runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True,
                             text=True, check=True).stderr
        line = next(l for l in err.splitlines() if l.rstrip().endswith("odb_factory_hook"))
        imports.append(int(line.split("|")[1]) / 1000)
    return {"python_start_hook_ms": 1000 * hook, "python_start_disabled_ms": 1000 * off,
            "hook_import_ms": statistics.median(imports)}


def time_to_first_step(lazy: bool, num_samples: int) -> float:
    """Seconds from launching `llamafactory-cli train` to its first training log line."""
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    model = build_tiny_qwen3vl(REPO / ".cache" / "tiny_qwen3vl", seed=0)
    data = CACHE / f"startup_data_{num_samples}"
    if not (data / "dataset_info.json").exists():
        write_demo_dataset(data, num_samples=num_samples, seed=1)
    out = CACHE / f"startup_{'lazy' if lazy else 'eager'}"
    config = {"model_name_or_path": str(model), "stage": "sft", "do_train": True,
              "finetuning_type": "full", "dataset": "odb_demo", "dataset_dir": str(data),
              "template": "qwen3_vl_nothink", "cutoff_len": 1024, "image_max_pixels": 65536,
              "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": str(out),
              "overwrite_output_dir": True, "report_to": "none", "logging_steps": 1, "max_steps": 2,
              "save_strategy": "no", "bf16": False, "dataloader_num_workers": 1,
              "odb_enable": True, "odb_token_budget": 1024, "odb_lazy_preprocess": lazy}
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = out.parent / f"{out.name}.log"
    start = time.perf_counter()
    proc = subprocess.Popen([str(LLAMAFACTORY_CLI), "train", str(path)], env=offline_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    with log.open("w") as fh:   # kept so that a failed run can be read afterwards
        for line in proc.stdout:
            fh.write(line)
            if first is None and "'loss'" in line:
                first = time.perf_counter() - start
    proc.wait()
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"start-up run failed ({proc.returncode}); see {log}")
    return first


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    figures = python_startup(runs=10 if args.quick else 30)
    samples = 1000 if args.quick else 4000
    figures[f"first_step_s_lazy_{samples}"] = time_to_first_step(True, samples)
    figures[f"first_step_s_eager_{samples}"] = time_to_first_step(False, samples)
    for key, value in figures.items():
        print(f"{key}: {value:.3f}")
    return figures


if __name__ == "__main__":
    main()
