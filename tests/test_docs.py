"""The README stays a short guide, and every relative link in the documentation resolves.

Checked: README.md has at most 300 lines; its quick start names the two set-up commands
(`make demo`, `make test`), each once in the whole README; its short YAML key table lists every
`odb_*` key with the default the generated reference in docs/configuration.md gives; every
relative link in README.md, bench/README.md and docs/*.md names an existing file, and a
`#anchor` into a markdown file names one of its headings (GitHub's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from odb_factory import options_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> List[Path]:
    return [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """`text` without fenced code blocks (their lines become empty)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return "\n".join(lines)


def fenced_lines(text: str) -> List[str]:
    """The lines inside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation other than '-' and
    '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading anchor of a markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: Dict[str, int] = {}
    result = set()
    for line in prose(path.read_text()).splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> List[str]:
    text = CODE_SPAN.sub("", prose(path.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        targets.append(target)
    return targets


def broken_links(path: Path) -> List[Tuple[str, str]]:
    """(link, why) for every relative link of `path` that does not resolve."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = path if file_part == "" else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append((target, f"no file {dest}"))
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append((target, f"no heading '#{anchor}' in {dest.name}"))
    return broken


def section(text: str, title: str) -> str:
    """The body of the `## title` section of `text`, up to the next heading of level 1 or 2."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


def test_readme_is_a_short_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move detail into docs/")


def test_the_quick_start_gives_the_two_set_up_commands_once():
    text = README.read_text()
    quick_start = section(text, "Quick start")
    for command in ("make demo", "make test"):
        in_block = [line for line in fenced_lines(quick_start)
                    if re.match(rf"\s*{command}(\s|$)", line)]
        assert len(in_block) == 1, f"the quick start's code block must run `{command}` once"
        mentions = re.findall(rf"{command}(?![-\w])", text)
        assert len(mentions) == 1, f"README.md names `{command}` {len(mentions)} times, not once"


def test_the_readme_key_table_matches_the_declarations():
    generated = {}
    for row in options_table.yaml_keys_table().splitlines()[2:]:
        key, default = [cell.strip() for cell in row.strip("|").split("|")[:2]]
        generated[key.strip("`")] = default
    listed = {}
    for row in section(README.read_text(), "YAML keys").splitlines():
        match = re.match(r"\|\s*`(odb_\w+)`\s*\|\s*([^|]+?)\s*\|", row)
        if match:
            listed[match.group(1)] = match.group(2)
    assert set(listed) == set(generated), (
        f"missing from README: {sorted(set(generated) - set(listed))}; "
        f"not declared: {sorted(set(listed) - set(generated))}")
    assert listed == generated


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    if path == README:
        assert relative_links(path), "no links found in README.md: is the link pattern broken?"
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `odb_step` key (samples, groups)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine too](other.md#the-odb_step-key-samples-groups) [self](#page)\n"
        "[missing file](nowhere.md) [missing heading](other.md#no-such-heading)\n"
        "`[in code](nowhere.md)` and a [web link](https://example.com/x.md)\n\n"
        "```\n[in a block](nowhere.md)\n```\n")
    assert [link for link, _ in broken_links(page)] == ["nowhere.md", "other.md#no-such-heading"]


def test_slugs_follow_github():
    assert slug("Results (`make bench`, this 2-core CPU machine, no GPU)") == \
        "results-make-bench-this-2-core-cpu-machine-no-gpu"
    assert slug("Two step modes: the same model, or the paper's") == \
        "two-step-modes-the-same-model-or-the-papers"
    assert slug("What changes with `odb_enable: true`") == "what-changes-with-odb_enable-true"
