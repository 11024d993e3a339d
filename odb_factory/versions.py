"""The upstream versions odb-factory supports, declared once. The patches, the argument
checks, the upstream contract (and the docs it generates) and the encoder-stage model patches
read them from here; `constraints.txt` pins the tested set, `make test-transformers-4.57` the
second one."""

from __future__ import annotations

from typing import Tuple

LLAMAFACTORY_VERSIONS = ("0.9.5",)
# Inclusive ranges. Within them the upstream contract (upstream_contract.py) decides; CI runs the
# full suite on 5.6.0 and the LLaMA-Factory end-to-end tests on 4.57.6 (`make test-transformers-4.57`).
TRANSFORMERS_4_57 = ("4.57.1", "4.57.6")
TRANSFORMERS_5 = ("5.0.0", "5.6.0")
TRANSFORMERS_RANGES = (TRANSFORMERS_4_57, TRANSFORMERS_5)
# The encoder-stage model patches (Qwen3-VL vision, Qwen2.5-Omni audio and vision) replace model
# methods whose code changes between releases: written for these only.
ENCODER_STAGE_TRANSFORMERS_5 = ("5.6.0", "5.6.0")
ENCODER_STAGE_TRANSFORMERS_RANGES = (TRANSFORMERS_4_57, ENCODER_STAGE_TRANSFORMERS_5)
TORCH_VERSIONS = ("2.14.1",)  # torch_serialization (the CPU-resume fix)
# transformers versions whose flash-attention path fails on every call of a model without
# attention sinks: integrations/flash_attention.py passes `s_aux.to(...)` with s_aux None.
FLASH_ATTENTION_BROKEN = ("5.6.0",)


def version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def in_ranges(version: str, ranges) -> bool:
    found = version_tuple(version)
    return any(version_tuple(low) <= found <= version_tuple(high) for low, high in ranges)


def transformers_supported(version: str) -> bool:
    return in_ranges(version, TRANSFORMERS_RANGES)


def encoder_stage_supported(version: str) -> bool:
    return in_ranges(version, ENCODER_STAGE_TRANSFORMERS_RANGES)


def describe(ranges) -> str:
    """"4.57.1–4.57.6 and 5.6.0" (a one-version range as the version)."""
    return " and ".join(low if low == high else f"{low}–{high}" for low, high in ranges)
