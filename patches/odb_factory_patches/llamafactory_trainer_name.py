"""What the sft, pt and dpo patches share: a module's trainer-class name replaced by a factory
that builds the ODB trainer (ODBTrainerMixin, or a subclass of it, in front of the upstream
class, with the run attached to the FinetuningArguments) when the run enables ODB, the
upstream class otherwise."""

from __future__ import annotations

from typing import Any


def replace_trainer_name(workflow: Any, name: str, odb_class_name: str, mixin: Any = None) -> bool:
    """Replace `workflow.<name>`; False when it was replaced already."""
    upstream = getattr(workflow, name)
    if getattr(upstream, "_odb_factory", False):
        return False

    from odb_factory.llamafactory.run import run_of
    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    odb_trainer = type(odb_class_name, (mixin or ODBTrainerMixin, upstream), {})

    def build_trainer(*args, **kwargs):
        run = run_of(kwargs.get("finetuning_args"))
        if run is None:
            return upstream(*args, **kwargs)
        return odb_trainer(*args, odb_run=run, **kwargs)

    build_trainer.__name__ = build_trainer.__qualname__ = name
    build_trainer._odb_factory = True
    build_trainer.__wrapped__ = upstream  # (what the upstream contract checks)
    setattr(workflow, name, build_trainer)
    return True
