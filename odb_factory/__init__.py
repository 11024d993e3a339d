"""odb_factory: Online Dynamic Batching and batch post-balancing for LLM/MLLM training.

The public API is `__all__`: a name listed there keeps working across a minor version; a
renamed one answers under its old name with a DeprecationWarning for one minor version
(CHANGELOG.md lists both). The LLaMA-Factory integration is used through YAML keys
(`odb_*`, docs/configuration.md), not imported.
"""

from .config import ODBConfig
from .cost import DefaultCost, SampleCost

__all__ = ["ODBConfig", "DefaultCost", "SampleCost", "ODBDataLoader", "ODBBatch", "scaled_loss",
           "weighted_token_sum", "__version__"]
__version__ = "0.2.0"

# names whose module pulls in torch.distributed or scipy: imported on first use only
# (post-balancing is `odb_factory.balance.balance`: a subpackage and a function of one name)
_LAZY = (("loader", ("ODBDataLoader", "ODBBatch")), ("loss", ("scaled_loss", "weighted_token_sum")))


def __getattr__(name):
    for module, names in _LAZY:
        if name in names:
            from importlib import import_module
            return getattr(import_module(f".{module}", __name__), name)
    raise AttributeError(name)
