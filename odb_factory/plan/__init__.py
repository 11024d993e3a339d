"""Deprecated name of `odb_factory.dry_run` (the dry run of a recipe), kept until 0.3:
importing it warns and answers with the dry run's modules."""

import sys
import warnings

from ..dry_run import budget, pipeline, recipe, render, report, speedup

warnings.warn("odb_factory.plan is deprecated: use odb_factory.dry_run (python -m odb_factory.dry_run)",
              DeprecationWarning, stacklevel=2)
for _module in (budget, pipeline, recipe, render, report, speedup):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
__all__ = ["budget", "pipeline", "recipe", "render", "report", "speedup"]
