"""Lazy per-sample preprocessing: LLaMA-Factory's own template, tokenisation, truncation and
vision-token expansion, run for one sample at a time inside the DataLoader workers.

No upfront `datasets.map` pass and no cache: changing the template, cutoff_len or image
pixels needs no rebuild, and each sample's cost is observed after the real pipeline.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Dict, List

REQUIRED_COLUMNS = ("_prompt", "_response")


# a processed pair's sides (LLaMA-Factory's PairwiseDatasetProcessor, data stage rm): the key
# prefix of each side's input_ids and labels, and its response among the row's `_response`
PAIR_SIDES = (("chosen_", 0), ("rejected_", 1))


def trainable_row(prompt: List[Any], response: List[Any], stage: str) -> bool:
    """Whether LLaMA-Factory's processor for data stage `stage` keeps a converted row: sft, an
    odd number of prompt turns and exactly one response; pt, a document (the first prompt
    turn's text); rm (the pairs of stage dpo), an odd number of prompt turns and a chosen and a
    rejected response."""
    if stage == "pt":
        return bool(prompt) and bool(prompt[0].get("content"))
    if stage == "rm":
        return len(prompt) % 2 == 1 and len(response) >= 2
    return len(prompt) % 2 == 1 and len(response) == 1


class TruncatedVisionTokensError(ValueError):
    """cutoff_len cut into a sample's image/video/audio tokens: the model cannot match them to
    the encoder's features, and would fail later with an opaque shape mismatch."""


class LazySupervisedDataset:
    """dataset[i] -> LLaMA-Factory's processed sample for converted row `rows[i]`.

    `converted` is the format-aligned dataset (`_prompt`, `_response`, `_system`, `_tools`,
    `_images`, `_videos`, `_audios`); `processor` is LLaMA-Factory's processor of data stage
    `stage` (SupervisedDatasetProcessor for sft, PretrainDatasetProcessor without packing for
    pt, PairwiseDatasetProcessor for rm: a chosen/rejected pair per sample, stage dpo). Rows
    LLaMA-Factory would drop as malformed (`trainable_row`) are left out up front, from the
    cheap format columns only.
    """

    def __init__(self, converted: Any, processor: Any, stage: str):
        missing = [c for c in REQUIRED_COLUMNS if c not in converted.column_names]
        if missing:
            raise ValueError(f"the converted dataset lacks columns {missing}; is it an SFT dataset?")
        prompts, responses = converted["_prompt"], converted["_response"]
        self.rows: List[int] = [i for i, (p, r) in enumerate(zip(prompts, responses))
                                if trainable_row(p, r, stage)]
        self.converted = converted
        self.processor = processor
        self.pairwise = stage == "rm"
        self.column_names = list(converted.column_names)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if not 0 <= index < len(self.rows):
            raise IndexError(index)
        row = self.converted[self.rows[index]]
        out = self.processor.preprocess_dataset({k: [v] for k, v in row.items()})
        if not next(iter(out.values()), None):
            raise ValueError(f"LLaMA-Factory's preprocessing dropped training row {self.rows[index]}")
        sample = {k: v[0] for k, v in out.items()}
        if self.pairwise:
            for prefix, response in PAIR_SIDES:
                self._check_vision_tokens(self.rows[index], row, sample[prefix + "input_ids"],
                                          row["_prompt"] + [row["_response"][response]])
        else:
            self._check_vision_tokens(self.rows[index], row, sample["input_ids"], row["_prompt"] + row["_response"])
        return sample

    def _check_vision_tokens(self, row_index: int, row: Dict[str, Any], input_ids: List[int],
                             messages: List[Dict[str, Any]]) -> None:
        """Fail, naming the row, when truncation kept only part of its image, video or audio
        tokens.

        Only a sample that reached cutoff_len and carries media can be affected; for those
        (rare) samples the plugin's expansion is recomputed and its media tokens counted, so
        the check costs nothing on the others."""
        cutoff = self.processor.data_args.cutoff_len
        images, videos = row.get("_images") or [], row.get("_videos") or []
        audios = row.get("_audios") or []
        if len(input_ids) < cutoff or not (images or videos or audios):
            return
        plugin, tokenizer = self.processor.template.mm_plugin, self.processor.tokenizer
        messages = plugin.process_messages(deepcopy(messages), images, videos, audios, self.processor.processor)
        for token, what, key in ((plugin.image_token, "image", "lower image_max_pixels"),
                                 (plugin.video_token, "video", "lower video_max_pixels"),
                                 (getattr(plugin, "audio_token", None), "audio", "shorten its audio")):
            if token is None:
                continue
            expected = sum(m["content"].count(token) for m in messages)
            token_id = tokenizer.convert_tokens_to_ids(token)
            kept = sum(1 for t in input_ids if t == token_id)
            if kept != expected:
                raise TruncatedVisionTokensError(
                    f"training row {row_index}: cutoff_len={cutoff} cuts into its {what} tokens "
                    f"(kept {kept} of {expected}), and the model cannot train on a partial {what}. "
                    f"Raise cutoff_len, {key}, or remove the row.")

    def dataset_row(self, index: int) -> int:
        """The converted dataset's row for ODB index `index` (what audit ledgers record)."""
        return self.rows[index]
