"""Pre-flight check for rows whose image, video or audio tokens `cutoff_len` would cut.

A model cannot train on part of an image: such a row fails when the lazy pipeline reaches it
(`LazySupervisedDataset._check_vision_tokens`), possibly late in the epoch. Before the first
step this pass finds them without running the pipeline on every row: an upper bound of each
row's tokens comes from its text's UTF-8 bytes (a byte-level or byte-fallback tokenizer never
makes more tokens than bytes), a per-turn allowance for the template, a per-image and
per-video bound from the processor's patch and merge sizes at the run's pixel limits (for an
image of any shape LLaMA-Factory's plugin and the processor accept), and a per-clip bound for
audio (a clip is cut to 30 s: at most 750 tokens, Qwen2.5-Omni). Only
rows whose bound reaches `cutoff_len` can be cut; those few are run through the real
pipeline, which says exactly whether their vision tokens survive.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, List, NamedTuple, Optional

from .lazy_dataset import TruncatedVisionTokensError

LISTED = 5                 # rows named in the error; the rest are counted
TEMPLATE_PER_MESSAGE = 16  # role markers and separators of one turn, in tokens (generous)
TEMPLATE_PER_ROW = 64      # BOS/EOS, generation prompt, thinking markers
MARKERS_PER_ITEM = 2       # vision start/end around each image or video frame group
VIDEO_TEXT_PER_FRAME = 8   # Qwen3-VL writes a timestamp before each frame group
# Whisper's feature extractor keeps at most 30 s (3,000 frames) of a clip: 750 audio tokens
PER_AUDIO = 750 + MARKERS_PER_ITEM


class VisionTokenBounds(NamedTuple):
    per_image: int
    per_video: int
    per_audio: int = PER_AUDIO


# Qwen-VL processors refuse images whose sides differ by more than this factor
MAX_ASPECT_RATIO = 200
# LLaMA-Factory's Qwen-VL plugin widens an image (or video frame) thinner than this to it, after
# scaling it to the run's pixel limits: a strip can end up with more pixels than the limit
MIN_SIDE = 28


def _plugin_pixels(limit: int) -> int:
    """Most pixels an image has after LLaMA-Factory's Qwen-VL plugin at a run limit of `limit`
    pixels: the limit, or a strip widened to MIN_SIDE pixels (its long side at most `limit`, as
    it was at least one pixel wide, and at most MAX_ASPECT_RATIO times MIN_SIDE)."""
    return max(limit, MIN_SIDE * min(limit, MAX_ASPECT_RATIO * MIN_SIDE))


def _pixels_to_tokens(pixels: float, side: int) -> int:
    """Most tokens of an image of at most `pixels` pixels, cut into side x side tiles per token,
    whatever its shape: the processor rounds each side to whole tiles (up to one more tile along
    each side, and a thin image's short side up to a whole tile), so beyond the area's tiles it
    adds at most (long + short side) / side of them."""
    # the most (long side + short side) / sqrt(area) can be, at the widest accepted ratio
    sides_per_root_area = math.sqrt(MAX_ASPECT_RATIO) + 1 / math.sqrt(MAX_ASPECT_RATIO)
    return math.ceil(pixels / side ** 2 + sides_per_root_area * math.sqrt(pixels) / side) + 1


# LLaMA-Factory's defaults where a processor carries no limit (its plugins read them so)
PIXEL_DEFAULTS = MappingProxyType({"image_max_pixels": 768 * 768, "image_min_pixels": 32 * 32,
                                   "video_max_pixels": 256 * 256, "video_min_pixels": 16 * 16,
                                   "video_maxlen": 128})


def _run_limit(processor: Any, *names: str) -> int:
    """The largest of the run's media limits `names`: LLaMA-Factory's `patch_processor` copies the
    model arguments' image/video pixel limits and frame count onto the processor, where its
    plugins read them."""
    return max(int(getattr(processor, name, None) or PIXEL_DEFAULTS[name]) for name in names)


def _processor_min_pixels(image_processor: Any) -> int:
    """The pixels the processor scales a smaller image up to (transformers 4.x: `min_pixels` or
    `size["shortest_edge"]`; 5.x: `size.shortest_edge` of a SizeDict)."""
    size = getattr(image_processor, "size", None)
    edge = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    return int(getattr(image_processor, "min_pixels", None) or edge or 0)


def vision_token_bounds(processor: Any) -> Optional[VisionTokenBounds]:
    """Upper bounds of one image's and one video's tokens, or None when the processor does not
    say how it tiles images (then the lazy check names cut rows when they are trained)."""
    image_processor = getattr(processor, "image_processor", None)
    patch = getattr(image_processor, "patch_size", None)
    merge = getattr(image_processor, "merge_size", None)
    if not (isinstance(patch, int) and isinstance(merge, int)):
        return None
    processor_min = _processor_min_pixels(image_processor)
    side = patch * merge

    image_pixels = max(_plugin_pixels(_run_limit(processor, "image_max_pixels", "image_min_pixels")), processor_min)
    video_pixels = max(_plugin_pixels(_run_limit(processor, "video_max_pixels", "video_min_pixels")), processor_min)
    per_image = _pixels_to_tokens(image_pixels, side) + MARKERS_PER_ITEM
    per_video = _run_limit(processor, "video_maxlen") * (_pixels_to_tokens(video_pixels, side) + MARKERS_PER_ITEM
                                                         + VIDEO_TEXT_PER_FRAME)
    return VisionTokenBounds(per_image, per_video)


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 0


def _count(item: Any) -> int:
    return len(item) if isinstance(item, (list, tuple)) else int(bool(item))


def token_upper_bounds(columns: dict, bounds: VisionTokenBounds, default_system: str = "") -> List[int]:
    """Per row of the converted columns (`_prompt`, `_response`, `_system`, `_tools`,
    `_images`, `_videos`, `_audios`): a number of tokens the pipeline cannot exceed."""
    n = len(columns["_prompt"])
    empty = [None] * n
    system_default = len(default_system.encode("utf-8"))
    out = []
    for prompt, response, system, tools, images, videos, audios in zip(
            columns["_prompt"], columns["_response"], columns.get("_system", empty),
            columns.get("_tools", empty), columns.get("_images", empty), columns.get("_videos", empty),
            columns.get("_audios", empty)):
        messages = len(prompt or []) + len(response or []) + 1
        out.append(_text_bytes(prompt) + _text_bytes(response)
                   + (_text_bytes(system) if system else system_default) + _text_bytes(tools)
                   + TEMPLATE_PER_MESSAGE * messages + TEMPLATE_PER_ROW
                   + _count(images) * bounds.per_image + _count(videos) * bounds.per_video
                   + _count(audios) * bounds.per_audio)
    return out


class CutoffReport(NamedTuple):
    candidates: int                 # rows whose bound reaches cutoff_len (run exactly)
    cut: List[str]                  # the pipeline's message for each row that is cut


def find_cut_rows(lazy: Any, threads: Optional[int] = None) -> Optional[CutoffReport]:
    """Run the bound over every training row of a LazySupervisedDataset and the real pipeline
    over the rows that could be cut. None when the processor gives no token bound."""
    dataset_processor = lazy.processor
    data_args = dataset_processor.data_args
    bounds = vision_token_bounds(dataset_processor.processor)
    if bounds is None:
        return None
    wanted = [c for c in ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")
              if c in lazy.converted.column_names]
    converted = lazy.converted
    # one arrow pass instead of a slice per row; the fallback reads the same lists
    if hasattr(converted, "select_columns"):  # pragma: no mutate, either path reads the same columns
        columns = converted.select_columns(wanted).to_dict()  # pragma: no mutate, as above
    else:
        columns = {c: list(converted[c]) for c in wanted}
    template = getattr(dataset_processor, "template", None)
    upper = token_upper_bounds(columns, bounds, getattr(template, "default_system", "") or "")
    media = [columns[c] for c in ("_images", "_videos", "_audios") if columns.get(c)]
    candidates = [i for i, row in enumerate(lazy.rows)
                  if upper[row] >= data_args.cutoff_len and any(m[row] for m in media)]

    def verdict(index: int) -> Optional[str]:
        try:
            lazy[index]
        except TruncatedVisionTokensError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:  # pragma: no mutate, threads
        cut = [v for v in pool.map(verdict, candidates) if v is not None]
    return CutoffReport(len(candidates), cut)


def check_cutoff(lazy: Any) -> Optional[CutoffReport]:
    """Raise TruncatedVisionTokensError naming the first rows cut and how many in all."""
    report = find_cut_rows(lazy)
    if report is None or not report.cut:
        return report
    cutoff = lazy.processor.data_args.cutoff_len
    lines = [f"  {message.split('. Raise')[0]}" for message in report.cut[:LISTED]]
    if len(report.cut) > LISTED:
        lines.append(f"  ... and {len(report.cut) - LISTED} more")
    raise TruncatedVisionTokensError(
        f"{len(report.cut)} training row(s) would lose image/video/audio tokens to cutoff_len={cutoff} "
        f"(found before training; {report.candidates} of {len(lazy)} rows could reach it and were "
        "run through the pipeline):\n" + "\n".join(lines)
        + "\nRaise cutoff_len, lower image_max_pixels/video_max_pixels, shorten the audio, or remove the rows; the run "
        "would otherwise fail when it reached them.")
