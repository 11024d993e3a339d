"""Pre-flight check of the training set's media files, before the first step.

The lazy pipeline opens a row's images, videos and audios only when the row is trained, so a
missing or unreadable file would stop the run wherever in the epoch that row falls (with
stock LLaMA-Factory's upfront `datasets.map` it stops before step 1). This pass restores
that: every local media path of every training row is checked once, in parallel threads
(the work is file-system calls): it must exist and its first bytes must read; an image must
start with a known image signature (PNG, JPEG, GIF, WebP, BMP, TIFF) or else open in PIL,
which parses the header, not the pixels. Decoding stays with the pipeline.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

MEDIA_COLUMNS = (("image", "_images"), ("video", "_videos"), ("audio", "_audios"))
LISTED = 5  # problems named in the error; the rest are counted


class MediaFileError(ValueError):
    """Training rows name media files that are missing or cannot be read."""


class MediaProblem(NamedTuple):
    row: int
    kind: str
    path: str
    reason: str


def _paths(item: Any) -> Iterator[str]:
    """Local file paths in one media entry (a video may be a list of frame files)."""
    if isinstance(item, str):
        if not item.startswith(("http://", "https://", "data:")):
            yield item
    elif isinstance(item, (list, tuple)):
        for part in item:
            yield from _paths(part)


# Magic numbers of the image formats training sets use; anything else is parsed by PIL.
IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM",
                    b"II*\x00", b"MM\x00*")


def _is_known_image(head: bytes) -> bool:
    return head.startswith(IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def file_problem(kind: str, path: str) -> Optional[str]:
    """Why `path` cannot be used as a `kind` file, or None."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(32)  # pragma: no mutate, any read of 12 bytes or more tells the signatures apart
        if not head:
            return "is empty"
        if kind == "image" and not _is_known_image(head):
            from PIL import Image
            with Image.open(path) as image:  # other formats: PIL parses the header only
                image.size
    except FileNotFoundError:
        return "does not exist"
    except Exception as exc:  # PIL's UnidentifiedImageError, permissions, a directory ...
        return f"cannot be read ({type(exc).__name__}: {exc})"
    return None


def _column(converted: Any, column: str) -> List[Any]:
    """One column as a Python list: a datasets.Dataset converts it in one arrow pass (indexing
    its Column row by row costs an arrow slice per row)."""
    if hasattr(converted, "select_columns"):  # pragma: no mutate, the fast path and the fallback read the same list
        return converted.select_columns([column]).to_dict()[column]  # pragma: no mutate, as above
    return list(converted[column])


def media_problems(converted: Any, rows: Sequence[int],
                   threads: Optional[int] = None) -> Tuple[List[MediaProblem], int]:
    """(problems in row order, number of distinct files checked) for the given rows of
    LLaMA-Factory's converted dataset."""
    uses: List[Tuple[int, str, str]] = []
    for kind, column in MEDIA_COLUMNS:
        if column not in converted.column_names:
            continue
        values = _column(converted, column)
        for row in rows:
            for path in _paths(values[row] or []):
                uses.append((row, kind, path))
    files = sorted({(kind, path) for _, kind, path in uses})
    with ThreadPoolExecutor(threads or min(32, 4 * (os.cpu_count() or 1))) as pool:  # pragma: no mutate, threads
        verdicts: Dict[Tuple[str, str], Optional[str]] = dict(
            zip(files, pool.map(lambda f: file_problem(*f), files)))
    problems = [MediaProblem(row, kind, path, verdicts[(kind, path)])
                for row, kind, path in sorted(uses) if verdicts[(kind, path)] is not None]
    return problems, len(files)


def check_media(converted: Any, rows: Sequence[int], media_dir: Optional[str] = None) -> int:
    """Raise MediaFileError naming the first rows at fault and how many in all; returns the
    number of files checked."""
    problems, checked = media_problems(converted, rows)
    if not problems:
        return checked
    bad_rows = len({p.row for p in problems})
    lines = [f"  training row {p.row}: {p.kind} {p.path} {p.reason}" for p in problems[:LISTED]]
    if len(problems) > LISTED:
        lines.append(f"  ... and {len(problems) - LISTED} more")
    where = f" (media_dir: {media_dir})" if media_dir else ""
    raise MediaFileError(
        f"{bad_rows} training row(s) name {len(problems)} media file(s) that cannot be used "
        f"(found before training; {checked} files checked):\n" + "\n".join(lines)
        + f"\nFix the paths{where} or remove the rows; the run would otherwise fail when it "
        "reached them.")
