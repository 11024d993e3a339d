"""Patches to third-party packages, one file per patched target (installed as the
`odb_factory_patches` package). Each file names the upstream version it was written for;
`apply()` refuses unsupported versions, and upstream code that breaks the contract in
`upstream_contract.py` (docs/upstream_contract.md), with a clear message.
"""

from __future__ import annotations

import logging

from odb_factory.versions import (LLAMAFACTORY_VERSIONS, TORCH_VERSIONS, TRANSFORMERS_RANGES, describe,
                                  transformers_supported)

logger = logging.getLogger("odb_factory")

_applied = False


def unsupported_reason() -> str | None:
    import llamafactory
    import transformers
    if llamafactory.__version__ not in LLAMAFACTORY_VERSIONS:
        return (f"odb-factory supports LLaMA-Factory {', '.join(LLAMAFACTORY_VERSIONS)}; "
                f"llamafactory {llamafactory.__version__} is installed")
    if not transformers_supported(transformers.__version__):
        return (f"odb-factory supports transformers {describe(TRANSFORMERS_RANGES)}; "
                f"transformers {transformers.__version__} is installed")
    return None


def cpu_resume_unsupported_reason() -> str | None:
    import torch
    if torch.__version__.split("+")[0] not in TORCH_VERSIONS:
        return (f"it was written for torch {', '.join(TORCH_VERSIONS)}; "
                f"torch {torch.__version__} is installed")
    from . import upstream_contract
    return upstream_contract.reason(gates=("cpu_resume",))


def apply() -> None:
    """Install every patch once. With an unsupported version, or upstream code that breaks
    the contract, only the argument guard is installed: YAML files with odb_* keys then fail
    with the reason, others run as upstream."""
    global _applied
    if _applied:
        return
    _applied = True
    from . import llamafactory_hparams_parser, upstream_contract
    reason = unsupported_reason() or upstream_contract.reason(gates=("odb",))
    llamafactory_hparams_parser.apply(unsupported=reason)
    if reason is not None:
        logger.warning("odb-factory patches not applied: %s", reason)
        return
    from . import (llamafactory_audio_reading, llamafactory_data_loader, llamafactory_dpo_trainer,
                   llamafactory_pt_workflow, llamafactory_sft_workflow)
    llamafactory_data_loader.apply()
    llamafactory_audio_reading.apply()
    llamafactory_sft_workflow.apply()
    llamafactory_pt_workflow.apply()
    llamafactory_dpo_trainer.apply()
    # every run, ODB or not: a rank's final evaluation gather can otherwise abort its exit
    from odb_factory.comm import exit_grace
    exit_grace.install()
    cpu_resume = cpu_resume_unsupported_reason()
    if cpu_resume is not None:
        logger.warning("odb-factory's CPU-resume fix (torch_serialization) is not installed, so "
                       "resuming a multi-process CPU run fails with \"don't know how to restore data "
                       "location ... cpu:0\": %s", cpu_resume)
        return
    from . import torch_serialization
    torch_serialization.apply()
