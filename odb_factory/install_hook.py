"""Install or remove the start-up hook by hand: `python -m odb_factory.install_hook [--remove]`.

A regular `pip install` puts `odb_factory_hook.pth` into site-packages with the package.
Editable installs (`pip install -e .`) do not carry extra files, so `make` runs this once.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

PTH_NAME = "odb_factory_hook.pth"
PTH_LINE = "import odb_factory_hook\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--remove", action="store_true")
    args = parser.parse_args(argv)
    path = pth_path()
    if args.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        path.write_text(PTH_LINE)
        print(f"installed {path}")


if __name__ == "__main__":
    main()
