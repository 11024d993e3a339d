"""A data set that stalls on one sample, as a stalled file system would."""

from __future__ import annotations

import time
from typing import Any, Optional


class StallsAt:
    """`inner`, whose sample `index` takes `seconds` to load (None: no sample stalls)."""

    def __init__(self, inner: Any, index: Optional[int], seconds: float = 15.0):
        self.inner, self.index, self.seconds = inner, index, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index == self.index:
            time.sleep(self.seconds)
        return self.inner[index]
