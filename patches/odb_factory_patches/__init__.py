"""Patches to third-party packages, one file per patched target (installed as the
`odb_factory_patches` package). Each file names the upstream version it was written for;
`apply()` refuses unsupported versions with a clear message.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("odb_factory")

LLAMAFACTORY_VERSIONS = ("0.9.5",)
TRANSFORMERS_RANGE = ("5.6.0", "5.6.0")  # inclusive; the 4.57 Trainer has other hook signatures

_applied = False


def _version_tuple(text: str):
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def unsupported_reason() -> str | None:
    import llamafactory
    import transformers
    if llamafactory.__version__ not in LLAMAFACTORY_VERSIONS:
        return (f"odb-factory supports LLaMA-Factory {', '.join(LLAMAFACTORY_VERSIONS)}; "
                f"llamafactory {llamafactory.__version__} is installed")
    low, high = (_version_tuple(v) for v in TRANSFORMERS_RANGE)
    if not low <= _version_tuple(transformers.__version__) <= high:
        return (f"odb-factory supports transformers {TRANSFORMERS_RANGE[0]}–{TRANSFORMERS_RANGE[1]}; "
                f"transformers {transformers.__version__} is installed")
    return None


def apply() -> None:
    """Install every patch once. With an unsupported version only the argument guard is
    installed: YAML files with odb_* keys then fail with the reason, others run as upstream."""
    global _applied
    if _applied:
        return
    _applied = True
    from . import llamafactory_hparams_parser
    reason = unsupported_reason()
    llamafactory_hparams_parser.apply(unsupported=reason)
    if reason is not None:
        logger.warning("odb-factory patches not applied: %s", reason)
        return
    from . import llamafactory_data_loader, llamafactory_sft_workflow
    llamafactory_data_loader.apply()
    llamafactory_sft_workflow.apply()
