"""The pre-flight's token bound of a row (odb_factory.llamafactory.cutoff_preflight): never
below what the real pipeline makes of an image (LLaMA-Factory's resize to the run's pixel
limits, then the Qwen-VL image processor's own), and exactly the documented sum otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, reject, settings
from hypothesis import strategies as st

pytest.importorskip("llamafactory")

from odb_factory.llamafactory.cutoff_preflight import (PER_AUDIO, VisionTokenBounds,  # noqa: E402
                                                       token_upper_bounds, vision_token_bounds)


def _image_processor(min_pixels: int = 1024):
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=min_pixels, max_pixels=4096 * 4096)


def _plugin():
    from llamafactory.data.mm_plugin import get_mm_plugin
    return get_mm_plugin("qwen2_vl", image_token="<|image_pad|>")


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 3000), height=st.integers(1, 3000),
       max_pixels=st.sampled_from([32 * 32, 4096, 65536, 250_000, 768 * 768]))
@example(width=1, height=307, max_pixels=32 * 32)     # strips the plugin widens to 28 pixels
@example(width=18, height=3000, max_pixels=65536)
@example(width=3000, height=1, max_pixels=768 * 768)  # wider than 1 : 200: the plugin reshapes it
def test_an_images_bound_is_never_below_its_real_tokens(width, height, max_pixels):
    from PIL import Image
    image_processor = _image_processor()
    processor = SimpleNamespace(image_processor=image_processor, image_max_pixels=max_pixels,
                                image_min_pixels=32 * 32)
    try:
        resized = _plugin()._preprocess_image(Image.new("RGB", (width, height)), image_max_pixels=max_pixels,
                                              image_min_pixels=32 * 32)
    except ValueError:  # LLaMA-Factory cannot train it either (a side scaled to 0 pixels)
        reject()
    t, h, w = image_processor(images=[resized], return_tensors="pt")["image_grid_thw"][0].tolist()
    tokens = t * h * w // 4 + 2  # merged 2x2 patches, and the vision start/end markers
    assert tokens <= vision_token_bounds(processor).per_image


def test_the_bounds_are_the_documented_sums():
    processor = SimpleNamespace(image_processor=_image_processor(), image_max_pixels=768 * 768,
                                image_min_pixels=32 * 32, video_max_pixels=256 * 256, video_min_pixels=16 * 16,
                                video_maxlen=4)
    # a side of 32 pixels a token: an image's area in tiles, plus its sides' rounding at the
    # widest shape the processor takes (1 : 200, 14.21 x sqrt(area) / 32), rounded up, + 1,
    # + 2 markers: 576 + 341.1 -> 918 + 1 + 2 at 768x768. A video frame at 256x256 may be a
    # strip LLaMA-Factory widens to 28 pixels (28 x 5,600 at most: 156,800 pixels):
    # 153.1 + 175.9 -> 329 + 1 + 2, + 8 timestamp tokens, 4 frames
    assert vision_token_bounds(processor) == VisionTokenBounds(921, 4 * 340, PER_AUDIO)
    # the limits are read from the processor (where LLaMA-Factory puts them), else they are
    # LLaMA-Factory's defaults (768x768 images, 256x256 video frames, 128 frames)
    bare = SimpleNamespace(image_processor=_image_processor())
    assert vision_token_bounds(bare) == VisionTokenBounds(921, 128 * 340)
    # a processor that scales small images up past the run's limits: its minimum is the bound
    # (1024x1024: 1024 + 454.8 -> 1479 + 1 + 2)
    upscaling = SimpleNamespace(image_processor=_image_processor(min_pixels=1024 * 1024), image_max_pixels=65536,
                                video_maxlen=1)
    assert vision_token_bounds(upscaling) == VisionTokenBounds(1482, 1482 + 8)
    assert vision_token_bounds(SimpleNamespace(image_processor=SimpleNamespace(patch_size=14))) is None
    assert vision_token_bounds(SimpleNamespace()) is None


def test_a_rows_bound_sums_its_text_bytes_template_and_media():
    bounds = VisionTokenBounds(per_image=100, per_video=1000, per_audio=10000)
    columns = {
        "_prompt": [[{"role": "user", "content": "héllo"}], [{"role": "user", "content": "ab"}]],
        "_response": [[{"role": "assistant", "content": "x"}], []],
        "_system": ["sys", ""],
        "_tools": ["", "[]"],
        "_images": [["a.png", "b.png"], None],
        "_videos": [None, ["v.mp4"]],
        "_audios": ["clip.wav", []],
    }
    # row 0: bytes of the message dicts' values ("user" 4 + "héllo" 6 + "assistant" 9 + "x" 1),
    # its own system (3), 16 per message (2 + 1), 64 per row, two images, one audio clip
    # row 1: "user" 4 + "ab" 2, the template's default system (7 bytes), tools "[]" 2,
    # 16 x (1 + 1), 64, one video
    assert token_upper_bounds(columns, bounds, default_system="default") == [
        20 + 3 + 16 * 3 + 64 + 2 * 100 + 10000,
        6 + 7 + 2 + 16 * 2 + 64 + 1000]
    only_text = {"_prompt": [[{"content": "four"}]], "_response": [[{"content": "five5"}]]}
    assert token_upper_bounds(only_text, bounds) == [4 + 5 + 16 * 3 + 64]


def test_each_limit_the_run_sets_moves_its_bound():
    """The run's limits on the processor, each away from LLaMA-Factory's default, move the bound
    they limit: the larger of an image's max and min pixels, a video frame's, the frame count."""
    base = dict(image_processor=_image_processor(), image_max_pixels=65536, image_min_pixels=1024,
                video_max_pixels=65536, video_min_pixels=256, video_maxlen=4)
    bounds = vision_token_bounds(SimpleNamespace(**base))
    for key, value, moved in (("image_min_pixels", 262144, "per_image"), ("video_max_pixels", 262144, "per_video"),
                              ("video_min_pixels", 262144, "per_video"), ("video_maxlen", 8, "per_video")):
        changed = vision_token_bounds(SimpleNamespace(**dict(base, **{key: value})))
        assert getattr(changed, moved) > getattr(bounds, moved), key
        assert changed._replace(**{moved: getattr(bounds, moved)}) == bounds, key


def test_the_processors_own_minimum_is_read_in_either_transformers_layout():
    """transformers 4.x keeps an image processor's minimum in `min_pixels`, 5.x in
    `size.shortest_edge` (a dict or a SizeDict): a minimum above the run's limit raises the
    bound alike in each."""
    def bound(**image_processor):
        return vision_token_bounds(SimpleNamespace(
            image_processor=SimpleNamespace(patch_size=16, merge_size=2, **image_processor),
            image_max_pixels=65536)).per_image
    plain = bound()
    high = 1024 * 1024
    assert bound(min_pixels=high) == bound(size={"shortest_edge": high}) \
        == bound(size=SimpleNamespace(shortest_edge=high)) > plain
    assert bound(size={"longest_edge": high}) == bound(size=SimpleNamespace(longest_edge=high)) == plain
