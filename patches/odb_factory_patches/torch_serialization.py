"""Target: torch.serialization location tags (written for torch 2.14.1).

On CPU, multi-process runs have `args.device == cpu:<rank>`, and HF's resume loads
optimizer.pt with `map_location=args.device`; torch's CPU deserializer accepts only the
plain "cpu" tag, so resuming any CPU DDP run fails with "don't know how to restore data
location ... (tagged with cpu:0)". This registers a deserializer for "cpu:<n>" tags that
keeps the storage on the CPU. Installed by `odb_factory_patches.apply()` on torch 2.14.1
(another version gets a warning instead); it only turns that load error into a CPU load, so
every other save and load is unchanged.
"""

from __future__ import annotations

import torch

_installed = False


def _never_tag(_obj):
    return None  # saving is unchanged


def _restore_indexed_cpu(storage, location):
    if isinstance(location, str) and location.startswith("cpu:"):
        return storage
    return None


def apply() -> None:
    global _installed
    if not _installed:
        torch.serialization.register_package(15, _never_tag, _restore_indexed_cpu)
        _installed = True
