"""odb_factory: Online Dynamic Batching and batch post-balancing for LLM/MLLM training."""

from .config import ODBConfig
from .cost import DefaultCost, SampleCost

__all__ = ["ODBConfig", "DefaultCost", "SampleCost", "ODBDataLoader", "ODBBatch"]
__version__ = "0.1.0"


def __getattr__(name):
    # The loader pulls in torch.distributed machinery; import it on first use only.
    if name in ("ODBDataLoader", "ODBBatch"):
        from . import loader
        return getattr(loader, name)
    raise AttributeError(name)
