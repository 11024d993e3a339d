"""What the LLaMA-Factory pre-flight checks cost before step 1, measured on a generated set.

    python -m bench.preflight [--rows 100000] [--cutoff-len 16384] [--data DIR]

Builds (once, into --data) the generated demo set with --rows rows, half with images (one
PNG file per image), and the tiny Qwen3-VL, parses a run with ODB enabled by LLaMA-Factory's
own parser and loader, and times the two passes the lazy path adds: the media check
(every image file: exists, reads, header) and the cutoff check (a token bound per row; the
real pipeline on the rows that could be cut). Synthetic data; the figures are this
machine's (2 cores here).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--cutoff-len", type=int, default=16384)
    parser.add_argument("--data", type=Path, default=Path(".cache/preflight_bench"))
    args = parser.parse_args(argv)

    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    data = args.data / f"rows_{args.rows}"
    if not (data / "demo_stats.json").is_file():
        write_demo_dataset(data, num_samples=args.rows)
    model = build_tiny_qwen3vl(args.data / "tiny_qwen3vl", seed=0)

    import llamafactory.train.tuner  # noqa: F401  (the import hook applies the patches)
    import odb_factory_patches
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    from odb_factory.llamafactory import cutoff_preflight, preflight
    odb_factory_patches.apply()
    timings: dict = {}
    for name, module, attr in (("media", preflight, "check_media"), ("cutoff", cutoff_preflight, "check_cutoff")):
        original = getattr(module, attr)

        def timed(*a, _original=original, _name=name):
            result, seconds = _timed(_original, *a)
            timings[_name] = (seconds, result)
            return result
        setattr(module, attr, timed)
    config = {"model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "full",
              "dataset": "odb_demo", "dataset_dir": str(data), "template": "qwen3_vl_nothink",
              "cutoff_len": args.cutoff_len, "output_dir": str(args.data / "out"), "overwrite_output_dir": True,
              "image_max_pixels": 65536, "report_to": "none", "odb_enable": True,
              "preprocessing_num_workers": 2}
    model_args, data_args, training_args, _, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    _, total = _timed(get_dataset, template, model_args, data_args, training_args, "sft", **tokenizer_module)
    media_s, files = timings["media"]
    cutoff_s, report = timings["cutoff"]
    result = {"rows": args.rows, "image_files": files, "media_check_s": round(media_s, 2),
              "cutoff_check_s": round(cutoff_s, 2), "cutoff_candidates": report.candidates,
              "cutoff_len": args.cutoff_len, "get_dataset_s": round(total, 2)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
