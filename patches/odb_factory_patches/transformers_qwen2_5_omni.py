"""Deprecated name of `odb_factory.encoder_stage.qwen2_5_omni_patch` (the model patch moved next to the
encoder stage it applies); importing it warns and hands over that module. Removed in 0.3."""

import sys
import warnings

from odb_factory.encoder_stage import qwen2_5_omni_patch

warnings.warn("odb_factory_patches.transformers_qwen2_5_omni is deprecated: import odb_factory.encoder_stage.qwen2_5_omni_patch",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = qwen2_5_omni_patch
