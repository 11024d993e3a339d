"""`python -m odb_factory.data prepare NAME --raw DIR --out DIR`: see odb_factory.data."""

from __future__ import annotations

import argparse
import sys

from odb_factory.token_lengths import CUTOFF_LEN, IMAGE_MAX_PIXELS

from .layouts import LAYOUTS
from .prepare import MIXTURE, Options, PrepareError, prepare
from .registry import MIXTURE_MEMBERS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m odb_factory.data",
                                     description="Prepare the recipes' data sets for LLaMA-Factory.")
    commands = parser.add_subparsers(dest="command", required=True)
    names = "; ".join(f"{k}: {v.title} ({v.repo})" for k, v in LAYOUTS.items())
    prep = commands.add_parser(
        "prepare", help="convert a data set as published into LLaMA-Factory files",
        description=f"Data sets: {names}; {MIXTURE}: the MM-Mix stand-in (not the paper's data), "
                    f"its members from the subfolders {', '.join(MIXTURE_MEMBERS)} of --raw, "
                    "each in its own published layout.")
    prep.add_argument("name", choices=[*LAYOUTS, MIXTURE])
    prep.add_argument("--raw", required=True, help="the folder the download left, untouched")
    prep.add_argument("--out", required=True,
                      help="output folder: pass it as dataset_dir= (files are added or replaced)")
    prep.add_argument("--image-root", help="the set's image folder, if not where its published "
                                           "archives unpack under --raw")
    prep.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder to count text "
                                          "tokens with (default: an estimate, bytes / 4)")
    prep.add_argument("--drop-missing", action="store_true",
                      help="leave out rows whose images are missing or unreadable (counted) "
                           "instead of stopping")
    prep.add_argument("--cutoff-len", type=int, default=CUTOFF_LEN,
                      help=f"the run's cutoff_len, for the statistics (default {CUTOFF_LEN})")
    prep.add_argument("--image-max-pixels", type=int, default=IMAGE_MAX_PIXELS,
                      help=f"the run's image_max_pixels, for the vision tokens "
                           f"(default {IMAGE_MAX_PIXELS})")
    prep.add_argument("--threads", type=int, help="threads checking the image files")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = Options(raw=args.raw, out=args.out, image_root=args.image_root,
                      tokenizer=args.tokenizer, drop_missing=args.drop_missing,
                      cutoff_len=args.cutoff_len, image_max_pixels=args.image_max_pixels,
                      threads=args.threads)
    try:
        prepare(args.name, options)
    except PrepareError as exc:
        print(f"prepare {args.name}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
