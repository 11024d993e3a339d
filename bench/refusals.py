"""When each bad input stops a LLaMA-Factory run, and with what message.

    python -m bench.refusals [--out .cache/refusals]

Runs `llamafactory-cli train` (one CPU process, the tiny Qwen3-VL, the generated demo set)
once per case and reports the first line of the error, the seconds from launch to exit, and
whether a training step ran before it. The configurations are the tests' (tests/helpers/lf_runs.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from tests.helpers.lf_runs import BIN, base_yaml, env


def _cases(model: Path, text_model: Path, data: Path, broken: Path):
    odb = {"odb_enable": True}
    yield "missing image file", base_yaml(model, broken, None, **odb), {}
    yield "image rows cut by cutoff_len", base_yaml(model, data, None, cutoff_len=128, **odb), {}
    yield "odb_enable: ture", base_yaml(model, data, None, odb_enable="ture"), {}
    yield "odb_token_budget: 4k", base_yaml(model, data, None, odb_token_budget="4k", **odb), {}
    yield "misspelt key odb_token_budgte", base_yaml(model, data, None, odb_token_budgte=4096, **odb), {}
    yield "tokenized_path", base_yaml(model, data, None, tokenized_path="tok", **odb), {}
    yield "use_kt (KTransformers)", base_yaml(model, data, None, use_kt=True, **odb), {}
    yield "use_hyper_parallel", base_yaml(model, data, None, use_hyper_parallel=True, **odb), {}
    # (USE_MCA=1 is not here: without mcore_adapter installed LLaMA-Factory stops on the import
    # first; tests/llamafactory/test_inprocess.py checks ODB's refusal of it)
    yield "packing: true", base_yaml(model, data, None, packing=True, **odb), {}
    yield "flash_attn: fa2", base_yaml(model, data, None, flash_attn="fa2", **odb), {}
    yield ("vision stage on a text model",
           base_yaml(text_model, data, None, odb_balance=True, odb_balance_stages=["llm", "vision"], **odb), {})
    yield "(reference: a valid run, one step)", base_yaml(model, data, None, max_steps=1, **odb), {}


def _first_error(text: str) -> str:
    """The last exception line, with the line after it when the message continues there."""
    lines = text.splitlines()
    found = [i for i, line in enumerate(lines)
             if line.split(":", 1)[0].endswith(("Error", "Exception")) or "Error: " in line[:80]]
    if not found:
        return lines[-1][:300]
    i = found[-1]
    message = lines[i] + (" " + lines[i + 1].strip() if lines[i].endswith(":") and i + 1 < len(lines) else "")
    return message[:400]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/refusals"))
    args = parser.parse_args(argv)
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    from odb_factory.demo.tiny_qwen3 import build_tiny_qwen3
    root = args.out.resolve()
    model = build_tiny_qwen3vl(root / "tiny_qwen3vl", seed=0)
    text_model = build_tiny_qwen3(root / "tiny_qwen3", seed=0)
    data = root / "data"
    if not (data / "demo_stats.json").is_file():
        write_demo_dataset(data, num_samples=96)
    broken = root / "broken"
    if not broken.exists():
        shutil.copytree(data, broken)
        rows = json.loads((broken / "demo.json").read_text())
        image_rows = [r for r in rows if r.get("images")]
        (broken / image_rows[len(image_rows) * 3 // 4]["images"][0]).unlink()  # late in the file
    print("| case | seconds from launch to exit | a training step ran | message |")
    print("|---|---|---|---|")
    for i, (name, config, extra) in enumerate(_cases(model, text_model, data, broken)):
        config["output_dir"] = str(root / f"run_{i}")
        path = root / f"run_{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        start = time.perf_counter()
        proc = subprocess.run([str(BIN / "llamafactory-cli"), "train", str(path)], env=env(**extra),
                              capture_output=True, text=True, timeout=900, cwd=str(root))
        seconds = time.perf_counter() - start
        output = proc.stdout + proc.stderr
        stepped = "{'loss'" in output or "'loss':" in output
        message = _first_error(output) if proc.returncode else "(trained, exit 0)"
        print(f"| {name} | {seconds:.1f} | {'yes' if stepped else 'no'} | {message.replace('|', '/')} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
