"""Lazy per-sample preprocessing: LLaMA-Factory's own template, tokenisation, truncation and
vision-token expansion, run for one sample at a time inside the DataLoader workers.

No upfront `datasets.map` pass and no cache: changing the template, cutoff_len or image
pixels needs no rebuild, and each sample's cost is observed after the real pipeline.
"""

from __future__ import annotations

from typing import Any, Dict, List

REQUIRED_COLUMNS = ("_prompt", "_response")


class LazySupervisedDataset:
    """dataset[i] -> LLaMA-Factory's processed sample for converted row `rows[i]`.

    `converted` is the format-aligned dataset (`_prompt`, `_response`, `_system`, `_tools`,
    `_images`, `_videos`, `_audios`); `processor` is LLaMA-Factory's
    SupervisedDatasetProcessor. Rows LLaMA-Factory would drop as malformed (a prompt that is
    not an odd number of turns, or not exactly one response) are left out up front, from
    the cheap format columns only.
    """

    def __init__(self, converted: Any, processor: Any):
        missing = [c for c in REQUIRED_COLUMNS if c not in converted.column_names]
        if missing:
            raise ValueError(f"the converted dataset lacks columns {missing}; is it an SFT dataset?")
        prompts, responses = converted["_prompt"], converted["_response"]
        self.rows: List[int] = [i for i, (p, r) in enumerate(zip(prompts, responses))
                                if len(p) % 2 == 1 and len(r) == 1]
        self.converted = converted
        self.processor = processor
        self.column_names = list(converted.column_names)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if not 0 <= index < len(self.rows):
            raise IndexError(index)
        row = self.converted[self.rows[index]]
        out = self.processor.preprocess_dataset({k: [v] for k, v in row.items()})
        if not out["input_ids"]:
            raise ValueError(f"LLaMA-Factory's preprocessing dropped training row {self.rows[index]}")
        return {k: v[0] for k, v in out.items()}

    def dataset_row(self, index: int) -> int:
        """The converted dataset's row for ODB index `index` (what audit ledgers record)."""
        return self.rows[index]
