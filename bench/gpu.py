"""`python -m bench.gpu`: the GPU layer, one prepared script for one GPU (about 8 minutes).

1. Coefficients. A randomly initialised Qwen3-VL with the real 2B shapes (the config is written
   here from the published architecture numbers: nothing is downloaded), bf16, sdpa (flash
   attention 2 only where `flash_attn` imports), trained as LLaMA-Factory trains it by default:
   full fine-tuning of the language model, vision tower and merger frozen, gradient
   checkpointing. Forward + backward of one micro-batch is timed over a grid of (rows, length,
   image patches); `bench.step_model.fit_step_model` fits the simulation's step form to the
   timings, set beside the coefficients the simulation assumes for an H20 (`gpu_steps.csv`,
   `gpu_coefficients.csv`).
2. Throughput. One epoch of a fixed sample subset of each paper profile (synthetic tokens and
   pixels with the profile's lengths and image sizes), AdamW steps included, through the real
   loaders: Standard (a torch DataLoader, batch 1, accumulation A), ODB `samples` (the same
   optimizer steps), ODB `groups` (budget-filled groups, fewer optimizer steps) and ODB
   `samples` padding-free (the same steps, each group one flattened row: `pack_group`). Every
   method must train every sample exactly once (checked); samples/s, real tokens/s and
   optimizer steps go to `gpu_throughput.csv`. The loss is transformers' mean per micro-batch
   for every method (the timings do not depend on how the loss is scaled).

    python -m bench.gpu [--out DIR] [--budget-s 420] [--samples 256] [--profiles A,B]
    python -m bench.gpu --dry-run --out DIR     # tiny config on CPU: the tests' check of this code

Synthetic inputs throughout (random weights, random token ids and pixels): the timings depend on
shapes, not values.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.llamafactory.padding_free import pack_group

from .step_model import FIT_COLUMNS, QWEN3_VL_2B, H20_1NODE, build_step_model, fit_step_model
from .tables import md_table, write_csv
from .workloads import PAPER_WORKLOADS

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
PATCH_DIM = 3 * 2 * 16 * 16       # channels x temporal patch x 16 x 16 pixels
MERGE = 2                         # 2x2 patches per LLM token


@dataclass(frozen=True)
class Shapes:
    """A Qwen3-VL configuration: the real 2B one, or the dry run's tiny one."""
    name: str
    text: dict
    vision: dict
    vocab: int
    image_token: int
    vision_start: int
    vision_end: int


# Qwen3-VL-2B: Qwen3-1.7B's language model (28 layers, hidden 2048, GQA 16/8, head 128) and the
# 24-layer, 1024-wide vision tower with deepstack features at layers 5, 11, 17.
QWEN3_VL_2B_SHAPES = Shapes(
    "Qwen3-VL-2B",
    text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
              tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                               "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
    vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17]),
    vocab=151936, image_token=151655, vision_start=151652, vision_end=151653)
TINY_SHAPES = Shapes(
    "tiny",
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                               "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                num_position_embeddings=256, deepstack_visual_indexes=[1]),
    vocab=512, image_token=500, vision_start=501, vision_end=502)


def build_model(shapes: Shapes, device: str, dtype: torch.dtype, attention: str):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from odb_factory.demo.tiny_model import rope_for_installed_transformers
    text = dict(rope_for_installed_transformers(dict(shapes.text)), vocab_size=shapes.vocab)
    config = Qwen3VLConfig(text_config=text, vision_config=shapes.vision, image_token_id=shapes.image_token,
                           vision_start_token_id=shapes.vision_start, vision_end_token_id=shapes.vision_end,
                           tie_word_embeddings=bool(shapes.text.get("tie_word_embeddings", False)))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, attn_implementation=attention, dtype=dtype)
    model.model.visual.requires_grad_(False)          # LLaMA-Factory's default: tower and merger frozen
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


# ----------------------------------------------------------------------------- synthetic samples
def image_grid(patches: int) -> tuple:
    """(1, h, w) with h, w even and h*w >= patches, close to square."""
    merged = max(1, math.ceil(patches / MERGE ** 2))
    a = max(1, int(math.isqrt(merged)))
    return (1, MERGE * a, MERGE * math.ceil(merged / a))


class SyntheticVLSamples(torch.utils.data.Dataset):
    """Sample i: `images[i]` images of `patches[i] / images[i]` patches each (as placeholder
    tokens framed by vision start/end), then text up to `tokens[i]` tokens; labels on the text."""

    def __init__(self, shapes: Shapes, tokens: Sequence[int], images: Sequence[int], patches: Sequence[int]):
        self.shapes, self.tokens, self.images, self.patches = shapes, list(tokens), list(images), list(patches)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s, g = self.shapes, torch.Generator().manual_seed(i)
        ids, labels, grids, pixels = [], [], [], 0
        for _ in range(self.images[i]):
            grid = image_grid(self.patches[i] // self.images[i])
            block = [s.vision_start] + [s.image_token] * (grid[1] * grid[2] // MERGE ** 2) + [s.vision_end]
            ids += block
            labels += [-100] * len(block)
            grids.append(grid)
            pixels += grid[1] * grid[2]
        text = max(8, self.tokens[i] - len(ids))
        # text ids below every vision id: a stray vision-start token would read as an image
        ids += torch.randint(0, min(s.vision_start, s.image_token), (text,), generator=g).tolist()
        labels += [-100] * 4 + ids[len(labels) + 4:]
        out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if grids:
            out["pixel_values"] = torch.randn(pixels, PATCH_DIM, generator=g)
            out["image_grid_thw"] = torch.tensor(grids)
        return out


def _model_wants_token_types() -> bool:
    """transformers 5.x's Qwen3-VL reads which tokens are image tokens from `mm_token_type_ids`
    (its processor returns them); 4.x finds them by id."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl
    return "mm_token_type_ids" in inspect.signature(modeling_qwen3_vl.Qwen3VLModel.forward).parameters


def pad_collate(samples: List[Dict[str, torch.Tensor]], image_token: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Right padding (ids 0, labels -100); pixels and grids concatenated in sample order;
    `mm_token_type_ids` (1 on `image_token`) where the installed model reads them."""
    width = max(len(x["input_ids"]) for x in samples)
    batch = {"input_ids": torch.zeros(len(samples), width, dtype=torch.long),
             "labels": torch.full((len(samples), width), -100, dtype=torch.long),
             "attention_mask": torch.zeros(len(samples), width, dtype=torch.long)}
    for row, x in enumerate(samples):
        n = len(x["input_ids"])
        batch["input_ids"][row, :n], batch["labels"][row, :n] = x["input_ids"], x["labels"]
        batch["attention_mask"][row, :n] = 1
    with_images = [x for x in samples if "pixel_values" in x]
    if with_images:
        batch["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images])
        batch["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in with_images])
    if image_token is not None and _model_wants_token_types():
        batch["mm_token_type_ids"] = (batch["input_ids"] == image_token).int()
    return batch


class PackedRopeCollate:
    """Padding-free groups: the padded batch, each row's multimodal rope positions computed by
    the model's own `get_rope_index`, then `pack_group` (one flattened row, no attention mask)."""

    def __init__(self, model, shapes: Shapes):
        self.rope_index = model.model.get_rope_index
        self.wants_types = "mm_token_type_ids" in inspect.signature(self.rope_index).parameters
        self.image_token = shapes.image_token

    def __call__(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        batch = pad_collate(samples, self.image_token)
        kwargs = {"input_ids": batch["input_ids"], "image_grid_thw": batch.get("image_grid_thw"),
                  "attention_mask": batch["attention_mask"]}
        if self.wants_types:   # transformers 5.x marks image tokens by type
            kwargs["mm_token_type_ids"] = (batch["input_ids"] == self.image_token).int()
        with torch.no_grad():
            batch["position_ids"], _ = self.rope_index(**kwargs)
        packed = pack_group(batch, [len(x["input_ids"]) for x in samples])
        packed.pop("odb_token_sample")
        return packed


# ----------------------------------------------------------------------------- part 1: coefficients
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _to(batch: Dict, device: str, dtype: torch.dtype) -> Dict:
    return {k: (v.to(device, dtype=dtype) if k == "pixel_values" else v.to(device)) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def time_micro_batch(model, batch: Dict, device: str, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of forward + backward (after one warm-up)."""
    batch = _to(batch, device, dtype)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        model(**batch).loss.backward()
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def grid_rows(model, shapes: Shapes, grid: Sequence[tuple], device: str, dtype: torch.dtype, repeats: int,
              deadline: float) -> List[dict]:
    """One timed micro-batch per (rows, length, patches per row) of `grid`, in the fit's columns."""
    out = []
    for rows, length, patches in grid:
        if time.perf_counter() > deadline:
            break
        data = SyntheticVLSamples(shapes, [length] * rows, [1 if patches else 0] * rows, [patches] * rows)
        batch = pad_collate([data[i] for i in range(rows)], shapes.image_token)
        width = batch["input_ids"].shape[1]
        p = batch["image_grid_thw"][:, 1:].prod(dim=1).tolist() if patches else []
        out.append({"rows": rows, "length": width, "patches_per_row": p[0] if p else 0,
                    "tokens": rows * width, "sum_sq": rows * width ** 2, "images": len(p), "patches": sum(p),
                    "patch_sq": sum(x * x for x in p),
                    "time_s": time_micro_batch(model, batch, device, dtype, repeats)})
    return out


def coefficient_rows(fit_coef: Dict[str, float], mfu: float) -> List[dict]:
    """Fitted coefficients beside the simulation's H20 ones (Qwen3-VL-2B, full FT, one GPU's share)."""
    sim = build_step_model(QWEN3_VL_2B, H20_1NODE, "full", mfu=mfu)
    simulated = {"c0": sim.c0, "tokens": sim.a, "sum_sq": sim.b, "images": sim.v0, "patches": sim.va,
                 "patch_sq": sim.vb}
    return [{"coefficient": k, "measured": fit_coef[k], "simulated_H20": simulated[k],
             "measured / simulated": fit_coef[k] / simulated[k] if simulated[k] else None}
            for k in ("c0",) + FIT_COLUMNS]


# ----------------------------------------------------------------------------- part 2: throughput
@dataclass
class Method:
    name: str
    make_loader: Callable[[], object]      # iterable of (batch, indices, optimizer step ends here)


def _standard_steps(data, collate, batch_size: int, accumulation: int, seed: int):
    loader = torch.utils.data.DataLoader(range(len(data)), batch_size=batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed), collate_fn=list)
    order = list(loader)
    for i, idx in enumerate(order):
        yield collate([data[j] for j in idx]), idx, (i + 1) % accumulation == 0 or i + 1 == len(order)


def _odb_steps(data, config: ODBConfig, collate):
    loader = ODBDataLoader(data, config, collate_fn=collate, num_workers=0, num_collate_workers=0)
    try:
        for step in loader:
            yield step.data, step.indices, step.optimizer_step_end
    finally:
        loader.close()


def methods(data, model, shapes: Shapes, budget: int, accumulation: int, seed: int) -> List[Method]:
    def odb(**kw) -> ODBConfig:
        return ODBConfig(token_budget=budget, seed=seed, loss_scaling="exact", buffer_size=64, **kw)
    samples = dict(step_mode="samples", standard_batch_size=1, gradient_accumulation_steps=accumulation)
    collate = functools.partial(pad_collate, image_token=shapes.image_token)
    return [
        Method("Standard bs=1", lambda: _standard_steps(data, collate, 1, accumulation, seed)),
        Method("ODB samples", lambda: _odb_steps(data, odb(**samples), collate)),
        Method("ODB groups", lambda: _odb_steps(data, odb(step_mode="groups"), collate)),
        Method("ODB samples padding-free",
               lambda: _odb_steps(data, odb(cost_mode="packed", **samples), PackedRopeCollate(model, shapes))),
    ]


def train_epoch(model, method: Method, n: int, device: str, dtype: torch.dtype) -> dict:
    """One epoch, AdamW stepping where the loader says; every sample exactly once (checked)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    seen: List[int] = []
    steps, tokens = 0, 0
    _sync(device)
    start = time.perf_counter()
    for batch, indices, step_end in method.make_loader():
        model(**_to(batch, device, dtype)).loss.backward()
        seen += list(indices)
        tokens += int(batch["labels"].numel() if "attention_mask" not in batch else batch["attention_mask"].sum())
        if step_end:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    _sync(device)
    seconds = time.perf_counter() - start
    if sorted(seen) != list(range(n)):
        raise AssertionError(f"{method.name}: trained {len(seen)} samples, {len(set(seen))} distinct, of {n}")
    return {"method": method.name, "samples": n, "seconds": seconds, "samples_per_s": n / seconds,
            "tokens_per_s": tokens / seconds, "optimizer_steps": steps}


def profile_subset(name: str, n: int, seed: int, scale: float = 1.0, max_tokens: Optional[int] = None):
    """`n` samples of a paper profile: (tokens, images, patches), lengths scaled for the dry run."""
    p = PAPER_WORKLOADS[name](max(n, 2000), seed)
    pick = np.random.default_rng(seed).choice(len(p), size=n, replace=False)
    tokens = np.maximum(16, np.rint(p.tokens[pick] * scale)).astype(int)
    patches = np.rint(p.patches[pick] * scale).astype(int)
    if max_tokens:
        tokens = np.minimum(tokens, max_tokens)
    images = np.where(patches > 0, np.maximum(1, p.images[pick]), 0)
    return tokens.tolist(), images.tolist(), np.where(images > 0, np.maximum(patches, 4 * images), 0).tolist()


# ----------------------------------------------------------------------------- command line
def run(out: Path, dry_run: bool, budget_s: float, samples: int, profiles: Sequence[str], mfu: float,
        log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Dict[str, List[dict]]:
    t0 = time.perf_counter()
    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not dry_run:
        raise SystemExit("bench.gpu: no CUDA device; --dry-run runs the tiny configuration on CPU")
    shapes = TINY_SHAPES if dry_run else QWEN3_VL_2B_SHAPES
    dtype = torch.float32 if dry_run else torch.bfloat16
    attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") and device == "cuda" else "sdpa"
    log(f"bench.gpu: {shapes.name}, {device}, {dtype}, {attention}")
    model = build_model(shapes, device, dtype, attention)
    if dry_run:
        grid = [(r, length, p) for r in (1, 2) for length in (32, 64) for p in (0, 16)]
        scale, budget, accumulation, repeats = 1 / 32, 256, 4, 1
    else:
        grid = [(r, length, p) for r in (1, 2, 4, 8) for length in (512, 1024, 2048, 4096, 8192)
                for p in (0, 1024, 2304) if r * length <= 32768]
        scale, budget, accumulation, repeats = 1.0, 16384, 8, 3
    rows = grid_rows(model, shapes, grid, device, dtype, repeats, t0 + 0.4 * budget_s)
    fit = fit_step_model(rows)
    log(f"bench.gpu: {len(rows)} micro-batches timed; fit MAPE {fit.mape:.3f}, R² {fit.r2:.3f}")
    coef = coefficient_rows(fit.coef, mfu)
    results = []
    for name in profiles:
        tokens, images, patches = profile_subset(name, samples, 0, scale, max_tokens=budget)
        data = SyntheticVLSamples(shapes, tokens, images, patches)
        for method in methods(data, model, shapes, budget, accumulation, seed=0):
            if time.perf_counter() - t0 > budget_s:
                results.append({"profile": name, "method": method.name, "note": "not run: time budget spent"})
                continue
            row = {"profile": name, "attention": attention, **train_epoch(model, method, len(data), device, dtype)}
            log(f"bench.gpu: {name}, {method.name}: {row['samples_per_s']:.2f} samples/s, "
                f"{row['optimizer_steps']} optimizer steps")
            results.append(row)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "gpu_steps.csv", [dict(r, predicted_s=p) for r, p in zip(rows, fit.predicted)])
    write_csv(out / "gpu_coefficients.csv", coef)
    write_csv(out / "gpu_throughput.csv", results)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shapes": shapes.name,
            "dtype": str(dtype), "attention": attention, "torch": torch.__version__,
            "fit_mape": fit.mape, "fit_r2": fit.r2, "seconds": time.perf_counter() - t0}
    (out / "gpu_meta.json").write_text(json.dumps(meta, indent=1))
    (out / "gpu_report.md").write_text("\n\n".join([
        f"## GPU layer ({meta['device']}, {shapes.name}, {dtype}, {attention}; synthetic inputs)",
        f"Step model fitted to {len(rows)} timed micro-batches (forward + backward): MAPE {fit.mape:.3f}, "
        f"R² {fit.r2:.3f}; the simulation's H20 coefficients at MFU {mfu} beside them.",
        md_table(coef, [(k, k) for k in coef[0]]),
        "Throughput through the real loaders, one epoch of the same samples per method:",
        md_table(results, [(k, k) for k in ("profile", "method", "samples", "samples_per_s", "tokens_per_s",
                                             "optimizer_steps", "note")])]) + "\n")
    return {"steps": rows, "coefficients": coef, "throughput": results}


def main(argv=None) -> Dict[str, List[dict]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="tiny config on CPU (what the tests run)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new work after this long")
    ap.add_argument("--samples", type=int, default=None, help="samples per profile (256; dry run 24)")
    ap.add_argument("--profiles", default="ShareGPT-4o-57K,LLaVA-Instruct-150K")
    ap.add_argument("--mfu", type=float, default=0.825, help="the simulation's efficiency, for the comparison")
    a = ap.parse_args(argv)
    samples = a.samples or (24 if a.dry_run else 256)
    profiles = [p for p in a.profiles.split(",") if p]
    unknown = [p for p in profiles if p not in PAPER_WORKLOADS]
    if unknown:
        ap.error(f"unknown profile(s) {unknown}; one of {sorted(PAPER_WORKLOADS)}")
    return run(a.out, a.dry_run, a.budget_s, samples, profiles, a.mfu)


if __name__ == "__main__":
    main()
