"""`prepare`: published files in, LLaMA-Factory files, registry and length statistics out.

One pass converts every record (`formats`), leaves out the rows LLaMA-Factory would skip or
stop on (counted, with the first ones named), counts each row's text tokens and writes the rows
to a scratch file. Then every image file is checked once, in threads, with the pre-flight check
the training run uses (`odb_factory.llamafactory.preflight`: it exists, its first bytes read, an
image header) and its size read from the header (PIL, no decoding) for the vision tokens. Rows
at fault stop the preparation with an error that names the first of them and counts all
(`--drop-missing` leaves them out instead, counted), before any output is written. Last, the
rows go to `<name>.parquet` with an explicit schema, the registry to `dataset_info.json`, the
statistics to `prepare_stats.json`.

Parquet rather than JSON lines: `datasets` infers a JSON-lines file's column types block by
block, and a block of text-only rows (LLaVA-665K has 40K) types `images` as a list of nulls,
which fails on the next block that names an image. A parquet file carries its schema.

Image paths are written relative to `media_dir`, the deepest folder that holds every image
root of the run (for one set, its image folder): LLaMA-Factory joins a relative media path
with `media_dir` for sets loaded from local files (`DatasetConverter._find_medias`), so the
command prints the `media_dir=` to pass with `dataset_dir=`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from odb_factory.llamafactory.preflight import LISTED, media_problems
from odb_factory.token_lengths import CUTOFF_LEN, IMAGE_MAX_PIXELS, image_patches

from . import formats, registry, stats
from .layouts import (
    LAYOUTS,
    Layout,
    LayoutError,
    annotation_files,
    image_root,
    records,
    where,
)

STATS_FILE = "prepare_stats.json"
MIXTURE = "mmmix"
MIXTURE_FRAGMENT = "mm_mix.yaml"
STAND_IN = ("MM-Mix stand-in: a public mixture in the character of the paper's MM-Mix, which is "
            "not public; results on it are not comparable with the paper's MM-Mix numbers.")


class PrepareError(RuntimeError):
    """The published files cannot be turned into a training set as they are."""


@dataclass(frozen=True)
class Options:
    raw: str
    out: str
    image_root: str | None = None
    tokenizer: str | None = None
    drop_missing: bool = False
    cutoff_len: int = CUTOFF_LEN
    image_max_pixels: int = IMAGE_MAX_PIXELS
    threads: int | None = None


@dataclass
class Member:
    """One data set of the run and what the conversion pass learnt about its rows."""
    layout: Layout
    raw: str
    files: list[str]
    image_root: str | None
    scratch: str = ""
    places: list[tuple[int, int]] = field(default_factory=list)   # (file, record) per row
    images: list[list[str]] = field(default_factory=list)         # absolute paths per row
    text_tokens: list[int] = field(default_factory=list)
    left_out: Counter = field(default_factory=Counter)             # reason -> rows
    left_out_where: dict[str, list[str]] = field(default_factory=dict)
    bad_rows: set[int] = field(default_factory=set)

    def where(self, row: int) -> str:
        file_index, record = self.places[row]
        return where(self.files[file_index], record, self.raw)


def members(key: str, options: Options) -> list[Member]:
    """The sets `key` names, each with its files and image root; all missing files in one error."""
    if key == MIXTURE:
        if options.image_root is not None:
            raise PrepareError("--image-root applies to one set; for mmmix put each member's "
                               "files (or a link to them) in its subfolder of --raw")
        plan = [(LAYOUTS[m], os.path.join(options.raw, m)) for m in registry.MIXTURE_MEMBERS]
    else:
        plan = [(LAYOUTS[key], options.raw)]
        if options.image_root is not None and not plan[0][0].has_images:
            raise PrepareError(f"{plan[0][0].title} has no images; --image-root does not apply")
    found, errors = [], []
    for layout, raw in plan:
        try:
            found.append(Member(layout, raw, annotation_files(layout, raw),
                                image_root(layout, raw, options.image_root)))
        except LayoutError as exc:
            errors.append(str(exc))
    if errors:
        raise PrepareError("\n".join(errors))
    return found


def media_dir_of(found: Sequence[Member]) -> str | None:
    roots = [m.image_root for m in found if m.image_root is not None]
    return os.path.commonpath(roots) if roots else None


def _relative(path: str, media_dir: str) -> str:
    """`path` relative to `media_dir`; one outside it (a record's own absolute path) stays."""
    inside = os.path.commonpath([path, media_dir]) == media_dir
    return os.path.relpath(path, media_dir) if inside else path


def convert(member: Member, media_dir: str | None, count: Callable[..., int]) -> None:
    """The conversion pass: rows LLaMA-Factory accepts go to the scratch file, with their image
    paths relative to `media_dir`; the others are counted by reason."""
    layout = member.layout
    with open(member.scratch, "w", encoding="utf-8") as out:
        for file_index, path in enumerate(member.files):
            for index, record in enumerate(records(path)):
                row = layout.convert(record)
                reason = formats.problem(row)
                if reason is not None:
                    member.left_out[reason] += 1
                    examples = member.left_out_where.setdefault(reason, [])
                    if len(examples) < 3:
                        examples.append(where(path, index, member.raw))
                    continue
                if layout.has_images:
                    absolute = [os.path.normpath(os.path.join(member.image_root, p))
                                for p in row["images"]]
                    row["images"] = [_relative(p, media_dir) for p in absolute]
                    member.images.append(absolute)
                member.places.append((file_index, index))
                member.text_tokens.append(count(row["messages"], len(row.get("images") or ())))
                out.write(json.dumps(row, ensure_ascii=False) + "\n")


class _ImageColumn(dict):
    """The one column the pre-flight check reads (`_images`), from plain lists."""
    column_names = ("_images",)


def _size(path: str) -> tuple[tuple[int, int] | None, str | None]:
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.size, None
    except Exception as exc:  # a header PIL cannot parse: the training run would fail on it
        return None, f"has no readable image header ({type(exc).__name__}: {exc})"


def check_media(member: Member, threads: int | None) -> tuple[dict[str, tuple[int, int]],
                                                                 list[tuple[int, str, str]], int]:
    """(image sizes, problems as (row, path, reason), files checked) for one set's images."""
    if not member.layout.has_images:
        return {}, [], 0
    found, checked = media_problems(_ImageColumn(_images=member.images),
                                    range(len(member.images)), threads)
    problems = [(p.row, p.path, p.reason) for p in found]
    bad_files = {p.path for p in found}
    files = sorted({path for paths in member.images for path in paths} - bad_files)
    with ThreadPoolExecutor(threads or min(32, 4 * (os.cpu_count() or 1))) as pool:
        read = dict(zip(files, pool.map(_size, files)))
    sizes = {path: size for path, (size, _) in read.items() if size is not None}
    for row, paths in enumerate(member.images):
        for path in paths:
            reason = read.get(path, (None, None))[1]
            if reason is not None:
                problems.append((row, path, reason))
    return sizes, sorted(problems), checked


def media_error(faults: Sequence[tuple[Member, int, str, str]], checked: int,
                media_dir: str | None) -> str:
    rows = len({(m.layout.name, row) for m, row, _, _ in faults})
    files = len({path for _, _, path, _ in faults})
    lines = [f"  {m.layout.name}, {m.where(row)}: image {path} {reason}"
             for m, row, path, reason in faults[:LISTED]]
    if len(faults) > LISTED:
        lines.append(f"  ... and {len(faults) - LISTED} more")
    return (f"{rows} row(s) name {files} image file(s) that cannot be used ({checked} files "
            f"checked; media_dir {media_dir}):\n" + "\n".join(lines)
            + "\nRestore the files, or pass --drop-missing to leave these rows out (counted). "
            "Nothing was written.")


def _schema(has_images: bool):
    import pyarrow as pa
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    fields = [("id", pa.string()), ("messages", pa.list_(message))]
    if has_images:
        fields.append(("images", pa.list_(pa.string())))
    return pa.schema(fields)


def write_rows(member: Member, path: str, batch: int = 2048) -> int:
    """The scratch rows but the bad ones, as parquet with the schema LLaMA-Factory reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema = _schema(member.layout.has_images)
    written, pending = 0, []
    with open(member.scratch, encoding="utf-8") as rows, pq.ParquetWriter(path, schema) as out:
        for index, line in enumerate(rows):
            if index in member.bad_rows:
                continue
            pending.append(json.loads(line))
            if len(pending) == batch:
                out.write_table(pa.Table.from_pylist(pending, schema=schema))
                written, pending = written + len(pending), []
        if pending:
            out.write_table(pa.Table.from_pylist(pending, schema=schema))
            written += len(pending)
    return written


def lengths(member: Member, sizes: dict[str, tuple[int, int]], max_pixels: int):
    """(text tokens, images, patches) per kept row."""
    text, images, patches = [], [], []
    for row, tokens in enumerate(member.text_tokens):
        if row in member.bad_rows:
            continue
        paths = member.images[row] if member.layout.has_images else []
        text.append(tokens)
        images.append(len(paths))
        patches.append(sum(image_patches(*sizes[p], max_pixels) for p in paths))
    return text, images, patches


def mixture_lengths(per_member: Sequence[tuple[list[int], list[int], list[int]]],
                    probabilities: Sequence[float]):
    """The rows an interleave_under epoch draws, in expectation: p_i * min_j(n_j / p_j) from
    set i (drawing stops when the first set runs out), taken from the head of each set."""
    epoch = min(len(t) / p for (t, _, _), p in zip(per_member, probabilities))
    pooled: tuple[list[int], list[int], list[int]] = ([], [], [])
    for (text, images, patches), p in zip(per_member, probabilities):
        take = int(p * epoch)
        for pool, values in zip(pooled, (text, images, patches)):
            pool.extend(values[:take])
    return pooled


def _merge_stats(path: str, report: dict[str, Any]) -> list[str]:
    """Write the run's statistics, keeping other sets' from earlier runs into the same folder;
    returns those whose images were prepared against another media_dir (one run trains with
    one media_dir, so such sets cannot be trained together as they are)."""
    existing: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            existing = json.load(handle)
    earlier = {k: v for k, v in existing.get("datasets", {}).items() if k not in report["datasets"]}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({**report, "datasets": {**earlier, **report["datasets"]}}, handle, indent=2)
        handle.write("\n")
    return sorted(k for k, v in earlier.items()
                  if v.get("media_dir") not in (None, report["media_dir"]) and report["media_dir"])


def prepare(key: str, options: Options, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare data set `key` (a LAYOUTS key or "mmmix"); returns what it printed as data."""
    found = members(key, options)
    media_dir = media_dir_of(found)
    out = os.path.abspath(options.out)
    os.makedirs(out, exist_ok=True)
    count = stats.counter(options.tokenizer)
    try:
        for member in found:
            member.scratch = os.path.join(out, f".{member.layout.name}.partial.jsonl")
            files = ", ".join(os.path.relpath(f, member.raw) for f in member.files)
            say(f"{member.layout.name}: reading {files} in {member.raw}")
            convert(member, media_dir, count)
        faults, checked, all_sizes = [], 0, {}
        for member in found:
            sizes, problems, n = check_media(member, options.threads)
            all_sizes.update(sizes)
            checked += n
            faults += [(member, row, path, reason) for row, path, reason in problems]
            member.bad_rows = {row for row, _, _ in problems}
        if faults and not options.drop_missing:
            raise PrepareError(media_error(faults, checked, media_dir))
        summaries, per_member, entries = [], [], {}
        for member in found:
            layout = member.layout
            file_name = f"{layout.name}.parquet"
            rows = write_rows(member, os.path.join(out, file_name))
            entries[layout.name] = registry.entry(file_name, layout.has_images)
            measured = lengths(member, all_sizes, options.image_max_pixels)
            per_member.append(measured)
            summaries.append(stats.summarize(layout.name, *measured, options.cutoff_len))
            say(f"{layout.name}: {rows:,} rows -> {os.path.join(out, file_name)}")
            for reason, n in member.left_out.most_common():
                say(f"  left out {n:,} row(s) LLaMA-Factory would skip or stop on: {reason} "
                    f"(e.g. {'; '.join(member.left_out_where[reason])})")
            if member.bad_rows:
                say(f"  left out {len(member.bad_rows):,} row(s) naming unusable images "
                    f"(--drop-missing), e.g. {member.where(min(member.bad_rows))}")
    finally:
        for member in found:
            if member.scratch and os.path.exists(member.scratch):
                os.remove(member.scratch)

    mixture = key == MIXTURE
    names = [m.layout.name for m in found]
    if mixture:
        probabilities = [float(p) for p in registry.MIXTURE_KEYS["interleave_probs"].split(",")]
        summaries.append(stats.summarize("mmmix (stand-in, one epoch)",
                                         *mixture_lengths(per_member, probabilities),
                                         options.cutoff_len))
    info = registry.write(out, entries)
    keys = registry.train_keys(names, out, media_dir, mixture)
    settings = {"token_rule": count.rule, "cutoff_len": options.cutoff_len,
                "image_max_pixels": options.image_max_pixels, "media_dir": media_dir}
    report = {**settings, "dataset_dir": out, "train_keys": keys,
              "datasets": {s["profile"]: {**s, **settings} for s in summaries}}
    apart = _merge_stats(os.path.join(out, STATS_FILE), report)

    say("\nLength statistics (the numbers of bench/README.md, 'Workload profiles'):\n"
        f"  text tokens: {count.rule}\n"
        f"  vision tokens: Qwen3-VL rule at image_max_pixels={options.image_max_pixels}; "
        f"tokens cut at cutoff_len={options.cutoff_len}")
    say(stats.table(summaries))
    say(f"Registry: {info}; statistics: {os.path.join(out, STATS_FILE)}")
    if apart:
        say(f"Note: {', '.join(apart)} in {out} name images under another media_dir; to train "
            "sets together, prepare them in one run (mmmix) so one media_dir serves all.")
    recipe = "recipes/qwen3vl_2b_odb.yaml" if mixture else found[0].layout.recipe
    if mixture:
        fragment = os.path.join(out, MIXTURE_FRAGMENT)
        with open(fragment, "w", encoding="utf-8") as handle:
            handle.write(registry.yaml_fragment(keys, STAND_IN + "\nWritten by python -m "
                                                "odb_factory.data prepare mmmix."))
        say(f"{STAND_IN}\nIts keys, as a recipe fragment: {fragment}")
    overrides = " ".join(f"{k}={v}" for k, v in keys.items())
    say(f"Pass these keys to llamafactory-cli train:\n  {overrides}")
    say(f"e.g. llamafactory-cli train {recipe} {overrides}")
    return report
