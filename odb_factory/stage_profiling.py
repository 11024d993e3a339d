"""Measure the per-stage cost models: time forward + backward, fit ``c0 + a*l + b*l**2``.

``python -m odb_factory.stage_profiling [--model DIR] [--lengths 64,128,...] [--repeats N]
[--stage llm|vision|both] [--json PATH]``

* **LLM stage**: the text model ``model.model.language_model`` on text-only ``input_ids`` of
  each length (batch 1); loss = mean of the squared last hidden state, so backward runs
  through every layer.
* **Audio stage** (Qwen2.5-Omni): the audio tower ``model.audio_tower`` on ``F`` valid mel
  frames, as one clip or cut into ``--clips`` equal clips (under sdpa/eager the tower's cost
  follows the total frames of the call however they are split; docs/encoder_balancing.md);
  ``l`` = frames. Default model for this stage: the tiny random Qwen2.5-Omni thinker.
* **Vision stage**: the vision tower ``model.model.visual`` on one image of ``P`` patches:
  ``pixel_values`` of shape ``(P, C * t * patch**2)`` and ``image_grid_thw = [[1, h, w]]``
  with ``h * w = P`` (``h``, ``w`` multiples of the spatial merge size; ``P`` is rounded up
  to a multiple of ``merge**2``, and the patch count actually used is reported).

Each point runs ``--warmup`` untimed iterations, then ``--repeats`` timed ones; the median
is used. ``fit_stage_cost_model`` (non-negative least squares) fits the medians; the result
is a ``StageCostModel`` in seconds per sample, printed with R^2 and the mean relative
error, and written as JSON with ``--json``. Without ``--model`` the tiny random Qwen3-VL is
built into ``.cache/tiny_qwen3vl`` (offline, seconds).

The fitted models are what ``balance(..., cost_model=...)`` and ``plan_vision`` take; only
ratios matter for balancing, so absolute seconds on a different machine are fine as long
as the shape (b / a, c0 / a) carries over.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .balance.cost_model import StageCostModel, fit_stage_cost_model

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
DEFAULT_MODEL_DIR = Path(".cache/tiny_qwen3vl")
STAGES = ("llm", "vision", "audio")
OMNI_TYPES = ("qwen2_5_omni",)
DEFAULT_OMNI_DIR = Path(".cache/tiny_qwen25omni")


def _int_list(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(out))


def image_grid(patches: int, merge: int) -> tuple[int, int, int]:
    """A near-square ``(1, h, w)`` grid with ``h``, ``w`` multiples of ``merge`` and
    ``h * w >= patches`` the smallest such product found (= ``patches`` rounded up to a
    multiple of ``merge**2`` whenever that has a divisor pair, which it always has: h = merge)."""
    units = max(1, -(-patches // (merge * merge)))  # merged tokens
    best = (1, units)
    for hu in range(1, math.isqrt(units) + 1):
        if units % hu == 0:
            best = (hu, units // hu)  # largest hu <= sqrt: the most square
    return 1, best[0] * merge, best[1] * merge


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _median_time(step: Callable[[], None], repeats: int, warmup: int, device: str) -> tuple[float, list[float]]:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "model_type", None) in OMNI_TYPES:  # the thinker holds the towers
        from transformers import Qwen2_5OmniForConditionalGeneration
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        return model.thinker.to(device).eval()
    if getattr(config, "model_type", None) not in ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen2_vl"):
        raise ValueError(f"{model_dir}: model_type {config.model_type!r} is not a Qwen-VL model "
                         "(the profiler needs model.model.language_model and model.model.visual)")
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device)
    model.eval()  # no dropout: timings should not depend on RNG; autograd still runs
    return model


def _llm_step(model, length: int, device: str, seed: int) -> Callable[[], None]:
    import torch

    lm = model.model.language_model
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(0, vocab, (1, length), generator=g).to(device)

    def step() -> None:
        out = lm(input_ids=ids, use_cache=False)
        out.last_hidden_state.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def _vision_step(model, grid: tuple[int, int, int], device: str, seed: int) -> Callable[[], None]:
    import torch

    visual = model.model.visual
    vc = model.config.vision_config
    t, h, w = grid
    row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    dtype = next(visual.parameters()).dtype
    g = torch.Generator().manual_seed(seed + t * h * w)
    pixels = torch.randn(t * h * w, row, generator=g).to(device=device, dtype=dtype)
    grid_thw = torch.tensor([[t, h, w]], dtype=torch.long, device=device)

    def step() -> None:
        out = visual(pixels, grid_thw=grid_thw)
        hidden = out.pooler_output if hasattr(out, "pooler_output") else out[0]
        loss = hidden.float().pow(2).mean()
        deep = getattr(out, "deepstack_features", None)
        if deep:
            loss = loss + sum(d.float().pow(2).mean() for d in deep)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _audio_step(model, frames: int, clips: int, device: str, seed: int) -> Callable[[], None]:
    import torch

    tower = model.audio_tower
    dtype = next(tower.parameters()).dtype
    g = torch.Generator().manual_seed(seed + frames)
    rows = torch.randn(tower.config.num_mel_bins, frames, generator=g).to(device=device, dtype=dtype)
    cut = [frames // clips + (1 if k < frames % clips else 0) for k in range(clips)]
    lens = torch.tensor([c for c in cut if c], dtype=torch.long, device=device)
    after_cnn, _ = tower._get_feat_extract_output_lengths(lens)

    def step() -> None:
        out = tower(rows, feature_lens=lens, aftercnn_lens=after_cnn)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        hidden.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def profile_stage(model, stage: str, lengths: Sequence[int], repeats: int = 3, warmup: int = 1,
                  device: str = "cpu", seed: int = 0, log: Callable[[str], None] | None = None,
                  clips: int = 1) -> dict[str, Any]:
    """Time one stage at every length and fit its cost model. Returns a JSON-able dict."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if stage == "audio" and not hasattr(model, "audio_tower"):
        raise ValueError("the audio stage needs a model with an audio tower (a Qwen2.5-Omni thinker)")
    used, medians, all_times = [], [], []
    for length in lengths:
        if stage == "llm":
            step, n = _llm_step(model, int(length), device, seed), int(length)
        elif stage == "audio":
            step, n = _audio_step(model, int(length), clips, device, seed), int(length)
        else:
            grid = image_grid(int(length), model.config.vision_config.spatial_merge_size)
            step, n = _vision_step(model, grid, device, seed), grid[0] * grid[1] * grid[2]
        med, times = _median_time(step, repeats, warmup, device)
        used.append(n)
        medians.append(med)
        all_times.append(times)
        if log:
            log(f"  {stage:6s} l={n:6d}  median {med * 1e3:9.3f} ms over {repeats}")
    fit = fit_stage_cost_model(used, medians)
    m = fit.model
    return {
        "stage": stage,
        "clips": clips if stage == "audio" else None,
        "unit": "seconds per sample (forward + backward)",
        "lengths": used,
        "median_s": medians,
        "times_s": all_times,
        "c0": m.c0, "a": m.a, "b": m.b,
        "r2": fit.r2,
        "mean_rel_error": fit.mean_rel_error,
        "crossover_length": (m.a / m.b) if m.b > 0 else None,  # where b*l^2 = a*l
    }


def stage_model(result: dict[str, Any]) -> StageCostModel:
    """The ``StageCostModel`` of one stage's result (e.g. from the JSON file)."""
    return StageCostModel(result["c0"], result["a"], result["b"])


def _format(result: dict[str, Any]) -> str:
    x = result["crossover_length"]
    return (f"{result['stage']:6s}  c0={result['c0']:.4e}  a={result['a']:.4e}  b={result['b']:.4e}  "
            f"R2={result['r2']:.4f}  mean_rel_err={result['mean_rel_error']:.2%}  "
            f"crossover l={'inf' if x is None else f'{x:.0f}'}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m odb_factory.stage_profiling",
        description="Time forward+backward of the LLM and vision stages and fit c0 + a*l + b*l^2.")
    p.add_argument("--model", default=None,
                   help=f"model directory (default: build the tiny Qwen3-VL into {DEFAULT_MODEL_DIR})")
    p.add_argument("--lengths", type=_int_list, default=list(DEFAULT_LENGTHS),
                   help="comma-separated token lengths (LLM) and, unless --patches, patch counts (vision)")
    p.add_argument("--patches", type=_int_list, default=None, help="comma-separated patch counts (vision)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--stage", choices=("llm", "vision", "both", "audio"), default="both",
                   help="both = llm and vision (Qwen-VL); audio needs a Qwen2.5-Omni thinker")
    p.add_argument("--clips", type=int, default=1, help="audio: cut each length into this many clips")
    p.add_argument("--device", default=None, help="cpu | cuda[:i] (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    log = (lambda s: None) if a.quiet else (lambda s: print(s, flush=True))
    if a.model is None and a.stage == "audio":
        from odb_factory.demo.tiny_omni import build_tiny_qwen25omni
        model_dir = build_tiny_qwen25omni(DEFAULT_OMNI_DIR)
    elif a.model is None:
        from odb_factory.demo.tiny_model import build_tiny_qwen3vl
        model_dir = build_tiny_qwen3vl(DEFAULT_MODEL_DIR)
    else:
        model_dir = Path(a.model)
    model = load_model(model_dir, device, a.dtype)
    torch.manual_seed(a.seed)

    stages = ("llm", "vision") if a.stage == "both" else (a.stage,)
    out: dict[str, Any] = {"model": str(model_dir), "device": device, "dtype": a.dtype,
                           "repeats": a.repeats, "warmup": a.warmup,
                           "threads": torch.get_num_threads(), "stages": {}}
    log(f"profiling {model_dir} on {device} ({a.dtype}, {torch.get_num_threads()} threads)")
    for stage in stages:
        lengths = a.patches if (stage == "vision" and a.patches) else a.lengths
        out["stages"][stage] = profile_stage(model, stage, lengths, a.repeats, a.warmup, device,
                                             a.seed, log, clips=a.clips)
    for stage in stages:
        print(_format(out["stages"][stage]))
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        log(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
