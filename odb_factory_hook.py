"""Imported at interpreter start-up by `odb_factory_hook.pth` (installed with odb-factory).

It only registers an import finder (no torch, no llamafactory import): when, and only
when, a process imports `llamafactory.train.tuner` — the CLI in one-process mode, and every
torchrun worker — the odb-factory patches are applied right after that module loads. Set
ODB_FACTORY_DISABLE=1 to turn it off.
"""

import os
import sys

TARGET = "llamafactory.train.tuner"


class _Loader:
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        import odb_factory_patches
        odb_factory_patches.apply()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PatchOnImport:
    """Meta-path finder that answers for TARGET only, by delegating to the other finders."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install():
    if os.environ.get("ODB_FACTORY_DISABLE", "") not in ("", "0"):
        return
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport())


install()
