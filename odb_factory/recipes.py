"""The recipes of `recipes/`, from a checkout or from an installed package.

    python -m odb_factory.recipes list
    python -m odb_factory.recipes write qwen3vl_8b_odb --out my_run/

The flat recipes refer to files beside them (`deepspeed: recipes/parts/deepspeed/...`,
`dataset_dir: recipes/data`), relative to a checkout's root. `write` copies a recipe with
those files into a folder of its own and points the paths there, so the recipe runs from
any directory. A wheel ships the recipes as package data (`odb_factory/recipes_data`,
written by setup.py); a checkout or an editable install reads `recipes/` itself.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

PACKAGED = Path(__file__).resolve().parent / "recipes_data"
CHECKOUT = Path(__file__).resolve().parents[1] / "recipes"
# what a flat recipe may refer to, as written in it (relative to a checkout's root)
DEEPSPEED_PREFIX = "recipes/parts/deepspeed/"
DATASET_DIR = "recipes/data"


def source_dir() -> Path:
    for folder in (PACKAGED, CHECKOUT):
        if (folder / "qwen3vl_8b_odb.yaml").is_file():
            return folder
    raise FileNotFoundError(f"no recipes found (looked in {PACKAGED} and {CHECKOUT}); "
                            "reinstall odb-factory")


def names(folder: Optional[Path] = None) -> List[str]:
    """Recipe names: file paths under the recipes folder without `.yaml` (`tiny/...` included)."""
    folder = folder or source_dir()
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")
                  if "parts" not in p.relative_to(folder).parts)


def describe(name: str, folder: Optional[Path] = None) -> str:
    """The recipe's first comment line (what it trains)."""
    first = ((folder or source_dir()) / f"{name}.yaml").read_text().splitlines()[0]
    return first.lstrip("# ").split(": ", 1)[-1]


def write(name: str, out: Path, folder: Optional[Path] = None) -> Path:
    """Copy recipe `name` and the files it refers to into `out`; returns the recipe's path."""
    folder = folder or source_dir()
    source = folder / f"{name}.yaml"
    if not source.is_file():
        raise ValueError(f"no recipe named {name!r}; choose one of: {', '.join(names(folder))}")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = source.read_text()
    if DEEPSPEED_PREFIX in text:
        (out / "deepspeed").mkdir(exist_ok=True)
        for config in (folder / "parts" / "deepspeed").glob("*.json"):
            shutil.copy(config, out / "deepspeed" / config.name)
        text = text.replace(DEEPSPEED_PREFIX, f"{out / 'deepspeed'}/")
    if f"dataset_dir: {DATASET_DIR}" in text:
        (out / "data").mkdir(exist_ok=True)
        shutil.copy(folder / "data" / "dataset_info.json", out / "data" / "dataset_info.json")
        text = text.replace(f"dataset_dir: {DATASET_DIR}", f"dataset_dir: {out / 'data'}")
    target = out / f"{Path(name).name}.yaml"
    target.write_text(text)
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m odb_factory.recipes", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the recipes and what each trains")
    writer = commands.add_parser("write", help="copy a recipe and the files it needs into a folder")
    writer.add_argument("name", help="a recipe name from `list`, e.g. qwen3vl_8b_odb")
    writer.add_argument("--out", type=Path, default=Path("."), help="folder to write into (default: .)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in names():
            print(f"{name:40s} {describe(name)}")
        return 0
    try:
        path = write(args.name, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}\nrun: llamafactory-cli train {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
