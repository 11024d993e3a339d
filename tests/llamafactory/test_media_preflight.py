"""The media pre-flight (odb_factory.llamafactory.preflight) on files written here: what it
accepts from a file's first bytes, what it hands to PIL, which paths it skips, and the
problems it reports per row for every media column."""

from __future__ import annotations

import io

import pytest
from datasets import Dataset
from PIL import Image

from odb_factory.llamafactory.preflight import (MediaFileError, MediaProblem, _paths, check_media, file_problem,
                                                media_problems)

SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff\xe0", "gif87": b"GIF87a", "gif89": b"GIF89a",
              "bmp": b"BM", "tiff_le": b"II*\x00", "tiff_be": b"MM\x00*", "webp": b"RIFF\x24\x00\x00\x00WEBPVP8 "}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_an_image_with_a_known_signature_passes_on_its_first_bytes(tmp_path, name):
    """Decoding stays with the pipeline: a known signature is enough, even before a cut file."""
    path = tmp_path / f"cut.{name}"
    path.write_bytes(SIGNATURES[name] + b"\x00" * 4)
    assert file_problem("image", str(path)) is None


def test_other_images_are_parsed_by_pil_and_a_riff_that_is_not_webp_is_no_image(tmp_path):
    pixmap = io.BytesIO()
    Image.new("RGB", (4, 4)).save(pixmap, "PPM")   # no known signature: PIL reads its header
    (tmp_path / "a.ppm").write_bytes(pixmap.getvalue())
    assert file_problem("image", str(tmp_path / "a.ppm")) is None
    (tmp_path / "sound.png").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 16)
    assert file_problem("image", str(tmp_path / "sound.png")).startswith(
        "cannot be read (UnidentifiedImageError: cannot identify image file")
    (tmp_path / "half.webp").write_bytes(b"WEBP" * 4)   # WEBP, but not after RIFF
    assert file_problem("image", str(tmp_path / "half.webp")).startswith("cannot be read (UnidentifiedImageError")


def test_videos_and_audios_need_only_exist_and_read(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not decoded here")
    (tmp_path / "empty.wav").write_bytes(b"")
    assert file_problem("video", str(tmp_path / "clip.mp4")) is None
    assert file_problem("audio", str(tmp_path / "clip.mp4")) is None
    assert file_problem("audio", str(tmp_path / "empty.wav")) == "is empty"
    assert file_problem("video", str(tmp_path / "gone.mp4")) == "does not exist"
    assert file_problem("image", str(tmp_path)).startswith("cannot be read (IsADirectoryError")


def test_urls_are_not_local_paths_and_frame_lists_are_walked():
    entry = ["a.png", "http://host/b.png", ["f1.jpg", ("f2.jpg", "https://host/f3.jpg")], "data:image/png;base64,AA",
             None, 3]
    assert list(_paths(entry)) == ["a.png", "f1.jpg", "f2.jpg"]
    assert list(_paths("HTTP://host/upper.png")) == ["HTTP://host/upper.png"]  # schemes as LLaMA-Factory reads them


def test_every_media_column_is_checked_and_problems_come_in_row_order(tmp_path):
    good = tmp_path / "good.png"
    good.write_bytes(SIGNATURES["png"])
    (tmp_path / "empty.wav").write_bytes(b"")
    # no _images column: the video and audio columns are still checked
    converted = Dataset.from_dict({"_videos": [[[str(tmp_path / "v.jpg")]], None,  # videos as frame files
                                               [[str(good), str(tmp_path / "f.jpg")]]],
                                   "_audios": [None, [str(tmp_path / "empty.wav")], [str(tmp_path / "empty.wav")]]})
    problems, checked = media_problems(converted, [2, 0, 1], threads=2)
    assert checked == 4   # distinct (kind, path): the empty clip is one file
    assert problems == [MediaProblem(0, "video", str(tmp_path / "v.jpg"), "does not exist"),
                        MediaProblem(1, "audio", str(tmp_path / "empty.wav"), "is empty"),
                        MediaProblem(2, "audio", str(tmp_path / "empty.wav"), "is empty"),
                        MediaProblem(2, "video", str(tmp_path / "f.jpg"), "does not exist")]
    assert media_problems(converted, [0], threads=1)[0] == problems[:1]   # only the rows asked for
    assert media_problems(Dataset.from_dict({"_images": [[str(good)]]}), [0]) == ([], 1)
    # converted rows that are not a datasets.Dataset: read column by column
    plain = {"_videos": converted["_videos"], "_audios": converted["_audios"]}
    assert media_problems(type("Columns", (dict,), {"column_names": list(plain)})(plain), [2, 0, 1],
                          threads=1) == (problems, 4)


def test_the_error_names_the_first_rows_and_counts_the_rest(tmp_path):
    converted = Dataset.from_dict({"_images": [[str(tmp_path / f"missing{i}.png")] for i in range(7)]})
    with pytest.raises(MediaFileError) as info:
        check_media(converted, range(7), media_dir="/data/media")
    assert str(info.value) == (
        "7 training row(s) name 7 media file(s) that cannot be used (found before training; 7 files checked):\n"
        + "".join(f"  training row {i}: image {tmp_path / f'missing{i}.png'} does not exist\n" for i in range(5))
        + "  ... and 2 more\n"
        "Fix the paths (media_dir: /data/media) or remove the rows; the run would otherwise fail when it reached them.")
    with pytest.raises(MediaFileError, match=r"^1 training row\(s\) name 1 media file\(s\) .*\n"
                                             r"  training row 3: image .* does not exist\n"
                                             r"Fix the paths or remove the rows"):
        check_media(converted, [3])
    with pytest.raises(MediaFileError) as five:   # as many as are listed: none left to count
        check_media(converted, range(5))
    assert str(five.value).count("\n  training row ") == 5 and "more" not in str(five.value)
    assert check_media(Dataset.from_dict({"_images": [[]]}), [0]) == 0
