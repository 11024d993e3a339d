"""Per-data-set row converters: one published record in, one LLaMA-Factory row out.

Every set is written in one shape, LLaMA-Factory's "sharegpt" formatting with OpenAI-style
tags (the shape of LLaMA-Factory's own `mllm_demo`):

    {"id": "...", "messages": [{"role": "user"|"assistant"|"system", "content": "..."}],
     "images": ["path", ...]}                  # images: only for sets that have them

so one registry entry shape (`registry.entry`) fits all of them. Images stay as the record
names them here; `prepare` resolves them against the set's image folder. The functions are
pure: no file is read, so each can be tested on a literal record.

`problem(row)` says why LLaMA-Factory 0.9.5 would skip a row (roles that do not alternate
user/assistant, a turn left unanswered: its converter then yields an empty example) or stop
on it (a different number of `<image>` placeholders than images, a `<video>`/`<audio>`
placeholder without the medium: its multimodal plugin raises mid-preprocessing). `prepare`
leaves such rows out and counts them, so no run meets them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IMAGE = "<image>"   # LLaMA-Factory's IMAGE_PLACEHOLDER (default of its env override)
VIDEO = "<video>"
AUDIO = "<audio>"

# LLaVA-style `from` values (LLaVA-Instruct, LLaVA-665K, ShareGPT-4o) -> LLaMA-Factory roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}

Row = dict[str, Any]


def _messages(turns: Sequence[Mapping[str, Any]], role_key: str, content_key: str,
              roles: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Turns renamed to role/content; an unknown role is kept as is (`problem` names it)."""
    out = []
    for turn in turns or ():
        role = turn.get(role_key)
        out.append({"role": roles.get(role, role) if roles else role,
                    "content": turn.get(content_key)})
    return out


def _image_list(value: Any) -> list[str]:
    """A record's image field (absent, one path or a list of paths) as a list."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def with_image_placeholder(row: Row) -> Row:
    """A one-image row whose text has no `<image>`: the placeholder put at the head of the first
    user turn, where LLaVA-style data puts it (LLaMA-Factory needs one placeholder per image)."""
    images = row.get("images") or []
    if len(images) != 1 or any(IMAGE in (m["content"] or "") for m in row["messages"]):
        return row
    messages = [dict(m) for m in row["messages"]]
    for m in messages:
        if m["role"] == "user" and isinstance(m["content"], str):
            m["content"] = f"{IMAGE}\n{m['content']}"
            break
    return {**row, "messages": messages}


def from_ultrachat(record: Mapping[str, Any]) -> Row:
    """HuggingFaceH4/ultrachat_200k: `messages` already role/content (user/assistant)."""
    return {"id": str(record.get("prompt_id", "")),
            "messages": _messages(record.get("messages"), "role", "content")}


def from_alpaca(record: Mapping[str, Any]) -> Row:
    """tatsu-lab/alpaca: instruction (+ "\\n" + input) as the user turn, as LLaMA-Factory's own
    alpaca converter joins them; output as the reply."""
    prompt = "\n".join(part for part in (record.get("instruction"), record.get("input")) if part)
    return {"id": "", "messages": [{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": record.get("output")}]}


def from_llava(record: Mapping[str, Any]) -> Row:
    """LLaVA-Instruct-150K and LLaVA-665K: `conversations` of from/value (human/gpt) and an
    optional `image` path (absent on the 665K's text-only rows); `<image>` is in the text."""
    return {"id": str(record.get("id", "")),
            "messages": _messages(record.get("conversations"), "from", "value", SHAREGPT_ROLES),
            "images": _image_list(record.get("image"))}


def from_sharegpt4o(record: Mapping[str, Any]) -> Row:
    """OpenGVLab/ShareGPT-4o image part: the LLaVA layout (`image`, `conversations` with
    human/gpt; the published rows carry no id, and also `width`/`height`, unused). Whether every
    row's text holds `<image>` could not be checked offline: a row without it gets one."""
    return with_image_placeholder(from_llava(record))


def problem(row: Row) -> str | None:
    """Why LLaMA-Factory would skip or stop on this row, or None."""
    messages = row.get("messages") or []
    if not messages:
        return "no messages"
    if any(not isinstance(m.get("content"), str) for m in messages):
        return "a turn without text"
    roles = [m["role"] for m in messages]
    if roles[0] == "system":
        roles = roles[1:]
    unknown = sorted({r for r in roles if r not in ("user", "assistant", "system")}, key=str)
    if unknown:
        return f"unknown role {unknown[0]!r}"
    if "system" in roles:
        return "a system turn after the first turn"
    if not roles or any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)):
        return "turns do not alternate user/assistant"
    if len(roles) % 2:
        return "last user turn has no reply"
    text = "".join(m["content"] for m in messages)
    images = len(row.get("images") or [])
    if text.count(IMAGE) != images:
        return f"{text.count(IMAGE)} {IMAGE} placeholder(s) for {images} image(s)"
    for placeholder in (VIDEO, AUDIO):
        if placeholder in text:
            return f"{placeholder} placeholder in a row without that medium"
    return None
