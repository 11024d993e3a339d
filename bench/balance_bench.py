"""Balancing benchmark: quality, planning time, bytes moved, and verl's partitioner beside ours.

``python -m bench.balance_bench [--quick] [--seeds N]`` prints markdown tables:

1. max/LB per stage before/after balancing -- LLM with the padded cost (``balance(mode=
   "padded", cost_model=QWEN3_VL_LLM)``; LB = padding-free lower bound) and with the plain sum
   cost (``lpt``), vision with LPT on ``QWEN3_VL_VISION`` (``plan_vision``) -- on generated
   multimodal steps and on the demo data (``bench.demo_workload.DEMO_DIR``, optional);
   verl's ``get_seqlen_balanced_partitions`` (Karmarkar-Karp) on the same instances;
2. planning time per step (lpt / padded / min_move, and verl KK) at 8/16/64 ranks x
   4/16/64 samples per rank;
3. bytes moved: naive vs assignment placement vs min_move (intra/inter node, 8 ranks/node).

Generated steps: text lengths lognormal (median 1024 tokens, sigma 1, clipped to
[16, 16384]); 0-3 images per sample (p = .4/.3/.2/.1), each a grid (1, h, w) with h, w
even and lognormal-ish (64..6400 patches); LLM length = text + patches / 4 (merge 2x2).
Demo data: every record of the demo json files, tokens = UTF-8 bytes of its text / 4,
images read with PIL and resized as Qwen3-VL does (patch 16, merge 2, <= 768x768 pixels);
samples are drawn with replacement per step. Bytes per sample (movement) = 4 x LLM tokens
for the LLM stage. Averages over seeds (quick: 2, full: 5). Not part of ``make test``.

verl is an optional comparator, installed by ``make venv`` with ``--no-deps`` (pinned in
constraints.txt); only its ``verl/utils/seqlen_balancing.py`` is loaded (see ``load_verl``).
Without it the verl columns read n/a and the first line says why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

from odb_factory.balance import QWEN3_VL_LLM, QWEN3_VL_VISION, balance
from odb_factory.balance.padded import padded_cost
from odb_factory.balance.vision_plan import local_plan, plan_vision

from .demo_workload import DEMO_DIR

RPN = 8
MERGE = 2
PATCH = 16
MAX_PIXELS = 768 * 768


# ---------------------------------------------------------------- verl comparator ----------
VERL_NOT_INSTALLED = ("verl is not installed: `make venv` installs it, or `pip install --no-deps "
                      "-c constraints.txt verl` (without its declared dependencies: they exclude our "
                      "transformers pin and pull in ray, wandb, ...; the partitioner needs none of them)")
# verl.utils.seqlen_balancing imports these at module level; the partitioner never uses them.
_VERL_STUBS = ("verl", "verl.protocol", "verl.utils", "verl.utils.tensordict_utils", "verl.utils.device")


def load_verl():
    """(verl's seqlen_balancing module or None, what was loaded or why not).

    Only that one source file of the installed package is loaded: importing the package pulls
    in ray, tensordict and more. Its three package imports are stubbed while it loads, and the
    stubs are removed again. Nothing is installed here."""
    try:
        dist = importlib.metadata.distribution("verl")
    except importlib.metadata.PackageNotFoundError:
        return None, VERL_NOT_INSTALLED
    target = Path(dist.locate_file("verl/utils/seqlen_balancing.py"))
    if not target.is_file():
        return None, f"verl {dist.version} is installed but has no {target}"
    stubs = {name: types.ModuleType(name) for name in _VERL_STUBS}
    stubs["verl"].__path__ = []
    stubs["verl.utils"].__path__ = []
    stubs["verl.protocol"].DataProto = object
    stubs["verl.utils.device"].get_device_name = lambda: "cpu"
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_verl_seqlen_balancing", target)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - report any failure and continue without verl
        return None, f"loading {target} failed: {type(e).__name__}: {e}"
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return mod, f"verl {dist.version}, {target.name} loaded on its own"


def kk_partition(verl, costs: np.ndarray, m: int, equal: bool) -> list[list[int]] | None:
    """verl's Karmarkar-Karp on integer workloads (costs scaled to ~1e6 resolution)."""
    n = len(costs)
    if n < m or (equal and n % m):
        return None
    scale = 1e6 / max(float(costs.max()), 1e-300)
    ints = [round(c * scale) for c in costs.tolist()]
    return verl.get_seqlen_balanced_partitions(ints, m, equal_size=equal)


# ---------------------------------------------------------------- instances ----------------
def _lognormal_side(rng, n):
    return np.clip(2 * np.round(np.exp(rng.normal(np.log(12), 0.6, n))), 8, 80).astype(int)


def gen_step(rng, m, k):
    """One step: per rank k samples -> (text lengths, image grids) per rank."""
    texts, grids = [], []
    for _ in range(m):
        t = np.clip(np.exp(rng.normal(np.log(1024), 1.0, k)), 16, 16384).astype(int)
        n_img = rng.choice(4, size=k, p=[0.4, 0.3, 0.2, 0.1])
        g = [[(1, int(h), int(w)) for h, w in zip(_lognormal_side(rng, c), _lognormal_side(rng, c))]
             for c in n_img]
        texts.append(t.tolist())
        grids.append(g)
    return texts, grids


def _resize(h, w):
    """(1, rows, cols) of patches: the processor's rounding to 32 px under 768x768 pixels.
    Simpler than bench.workloads.image_grid (no LLaMA-Factory pre-shrink, no minimum size)
    and kept as it is so that this benchmark's figures stay comparable between runs."""
    f = PATCH * MERGE
    hh, ww = max(f, round(h / f) * f), max(f, round(w / f) * f)
    if hh * ww > MAX_PIXELS:
        beta = math.sqrt(h * w / MAX_PIXELS)
        hh, ww = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
    return 1, hh // PATCH, ww // PATCH


def load_demo():
    """(text tokens, [grids]) per demo record, or None if the data is absent."""
    files = sorted(DEMO_DIR.glob("*.json")) if DEMO_DIR.is_dir() else []
    if not files:
        return None
    try:
        from PIL import Image
    except ImportError:
        Image = None
    pool = []
    for f in files:
        for rec in json.loads(f.read_text(encoding="utf-8")):
            imgs = rec.get("images") or [] if isinstance(rec, dict) else []
            text = {k: v for k, v in rec.items() if k not in ("images", "videos")}
            tokens = max(1, len(json.dumps(text, ensure_ascii=False).encode()) // 4)
            g = []
            for p in imgs:
                path = DEMO_DIR / p
                if Image is not None and path.is_file():
                    with Image.open(path) as im:
                        g.append(_resize(im.height, im.width))
            pool.append((tokens, g))
    return pool


def demo_step(rng, pool, m, k):
    idx = rng.integers(0, len(pool), size=(m, k))
    return ([[pool[i][0] for i in row] for row in idx], [[pool[i][1] for i in row] for row in idx])


def llm_lengths(texts, grids):
    return [[t + sum(a * b * c for a, b, c in g) // (MERGE * MERGE) for t, g in zip(ts, gs)]
            for ts, gs in zip(texts, grids)]


# ---------------------------------------------------------------- table 1 ------------------
def quality(instances, verl):
    """Mean max/LB per column over the instances (list of (texts, grids))."""
    cols = {k: [] for k in ("pad_before", "padded", "lpt_as_pad", "kk_as_pad", "sum_before", "lpt",
                            "kk", "vis_before", "vis_lpt", "vis_mm", "vis_kk")}
    for texts, grids in instances:
        m = len(texts)
        lens = llm_lengths(texts, grids)
        cost = [QWEN3_VL_LLM(np.asarray(l, float)).tolist() for l in lens]
        pad = balance(cost, RPN, "padded", lengths_per_rank=lens, cost_model=QWEN3_VL_LLM)
        lpt = balance(cost, RPN, "lpt")
        lb_pad = pad.lower_bound
        cols["pad_before"].append(max(pad.cost_before) / lb_pad)
        cols["padded"].append(pad.max_over_lb)
        flat_len = np.concatenate([np.asarray(l, float) for l in lens])
        flat_cost = np.concatenate([np.asarray(c, float) for c in cost])
        src_off = np.cumsum([0] + [len(l) for l in lens])
        lpt_pad = max(padded_cost(QWEN3_VL_LLM(np.asarray(
            [flat_len[src_off[r] + p] for r, p in d], float))) if d else 0.0 for d in lpt.destinations)
        cols["lpt_as_pad"].append(lpt_pad / lb_pad)
        cols["sum_before"].append(max(lpt.cost_before) / lpt.lower_bound)
        cols["lpt"].append(lpt.max_over_lb)
        if verl is not None:
            parts = kk_partition(verl, flat_cost, m, equal=True)
            if parts is not None:
                cols["kk"].append(max(math.fsum(flat_cost[p].tolist()) for p in parts) / lpt.lower_bound)
                cols["kk_as_pad"].append(max(padded_cost(QWEN3_VL_LLM(flat_len[p])) for p in parts)
                                         / lb_pad)
        if sum(len(g) for gs in grids for g in gs):
            vgrids = [[x for g in gs for x in g] for gs in grids]
            before = local_plan(vgrids, MERGE, QWEN3_VL_VISION)
            vl = plan_vision(vgrids, MERGE, QWEN3_VL_VISION, ranks_per_node=RPN, mode="lpt")
            vm = plan_vision(vgrids, MERGE, QWEN3_VL_VISION, ranks_per_node=RPN, mode="min_move")
            lb = vl.lower_bound
            cols["vis_before"].append(max(before.cost_before) / lb)
            cols["vis_lpt"].append(max(vl.cost_after) / lb)
            cols["vis_mm"].append(max(vm.cost_after) / lb)
            if verl is not None:
                vc = np.asarray([QWEN3_VL_VISION(h * w) for gs in vgrids for _, h, w in gs], float)
                parts = kk_partition(verl, vc, m, equal=False)
                if parts is not None:
                    cols["vis_kk"].append(max(math.fsum(vc[p].tolist()) for p in parts) / lb)
    return {k: (statistics.fmean(v) if v else None) for k, v in cols.items()}


def _f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


# ---------------------------------------------------------------- tables 2, 3 --------------
def _ms(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.balance_bench")
    p.add_argument("--quick", action="store_true", help="fewer seeds/repeats (< 1 min)")
    p.add_argument("--seeds", type=int, default=None)
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    seeds = a.seeds or (2 if a.quick else 5)
    reps = 3 if a.quick else 7

    verl, how = load_verl()
    print("# Balancing benchmark\n")
    print(f"verl comparator: {how}" if verl is not None else f"verl comparator skipped: {how}")
    print()

    # ---- table 1
    shapes = [(8, 4), (8, 16), (16, 16), (64, 4)] if a.quick else \
        [(8, 4), (8, 16), (8, 64), (16, 16), (64, 4), (64, 16)]
    pool = load_demo()
    rows = []
    for m, k in shapes:
        inst = [gen_step(np.random.default_rng(1000 * s + m * 7 + k), m, k) for s in range(seeds)]
        rows.append((f"generated {m}x{k}", quality(inst, verl)))
    if pool is None:
        print(f"(demo data not found under {DEMO_DIR}: skipped)\n")
    else:
        for m, k in [(8, 16), (16, 16)] if a.quick else [(8, 4), (8, 16), (16, 16), (64, 16)]:
            inst = [demo_step(np.random.default_rng(5000 + 1000 * s + m * 7 + k), pool, m, k)
                    for s in range(seeds)]
            rows.append((f"demo {m}x{k}", quality(inst, verl)))
    print(f"## 1. max/LB per stage (mean over {seeds} seeds; ranks x samples per rank)\n")
    print("LLM padded = count x g(longest) per rank against the padding-free LB; LLM sum = "
          "Σ g(l). Vision = Σ QWEN3_VL_VISION(patches) per rank. KK = verl "
          "get_seqlen_balanced_partitions (LLM: equal_size=True, vision: equal_size=False).\n")
    print("| instance | LLM padded: before | padded | lpt plan | verl KK | LLM sum: before | lpt "
          "| verl KK | vision: before | lpt | min_move | verl KK |")
    print("|---|" + "---|" * 11)
    for name, q in rows:
        print(f"| {name} | {_f(q['pad_before'])} | {_f(q['padded'])} | {_f(q['lpt_as_pad'])} | "
              f"{_f(q['kk_as_pad'])} | {_f(q['sum_before'])} | {_f(q['lpt'])} | {_f(q['kk'])} | "
              f"{_f(q['vis_before'])} | {_f(q['vis_lpt'])} | {_f(q['vis_mm'])} | {_f(q['vis_kk'])} |")
    print()

    # ---- table 2
    print(f"## 2. planning time per step, ms (median of {reps}; LLM stage, generated lengths)\n")
    print("| ranks x samples/rank | lpt | padded | min_move | verl KK (equal) |")
    print("|---|---|---|---|---|")
    for m in (8, 16, 64):
        for k in (4, 16, 64):
            texts, grids = gen_step(np.random.default_rng(77 + m + k), m, k)
            lens = llm_lengths(texts, grids)
            cost = [QWEN3_VL_LLM(np.asarray(l, float)).tolist() for l in lens]
            sizes = [[4 * x for x in l] for l in lens]
            r = reps if m * k < 4096 else max(1, reps // 3)
            t_lpt = _ms(lambda: balance(cost, RPN, "lpt", sizes_per_rank=sizes), r)
            t_pad = _ms(lambda: balance(cost, RPN, "padded", sizes_per_rank=sizes,
                                        lengths_per_rank=lens, cost_model=QWEN3_VL_LLM), r)
            t_mm = _ms(lambda: balance(cost, RPN, "min_move", sizes_per_rank=sizes), r)
            flat = np.concatenate([np.asarray(c, float) for c in cost])
            t_kk = _ms(lambda: kk_partition(verl, flat, m, True), r) if verl is not None else None
            print(f"| {m} x {k} | {t_lpt:.2f} | {t_pad:.2f} | {t_mm:.2f} | {_f(t_kk, '{:.2f}')} |")
    print()

    # ---- table 3
    print(f"## 3. bytes moved, % of all bytes (intra / inter node; {RPN} ranks per node; "
          f"bytes = 4 x LLM tokens; mean over {seeds} seeds)\n")
    print("| ranks x samples/rank | lpt naive | lpt assignment | padded naive | padded assignment "
          "| min_move | verl KK (part i → rank i) |")
    print("|---|---|---|---|---|---|---|")
    for m, k in [(8, 16), (16, 16), (64, 16)] if a.quick else [(8, 16), (16, 16), (16, 64), (64, 16), (64, 64)]:
        acc = {c: [] for c in ("ln", "la", "pn", "pa", "mm", "kk")}
        for s in range(seeds):
            texts, grids = gen_step(np.random.default_rng(9000 + 100 * s + m + k), m, k)
            lens = llm_lengths(texts, grids)
            cost = [QWEN3_VL_LLM(np.asarray(l, float)).tolist() for l in lens]
            sizes = [[4.0 * x for x in l] for l in lens]
            total = sum(map(sum, sizes))
            pk = dict(lengths_per_rank=lens, cost_model=QWEN3_VL_LLM)
            for c, plan in (("ln", balance(cost, RPN, "lpt", sizes_per_rank=sizes, placement="naive")),
                            ("la", balance(cost, RPN, "lpt", sizes_per_rank=sizes)),
                            ("pn", balance(cost, RPN, "padded", sizes_per_rank=sizes, placement="naive", **pk)),
                            ("pa", balance(cost, RPN, "padded", sizes_per_rank=sizes, **pk)),
                            ("mm", balance(cost, RPN, "min_move", sizes_per_rank=sizes))):
                acc[c].append((plan.bytes_intra_node / total, plan.bytes_inter_node / total))
            if verl is not None:
                flat_size = np.asarray([x for l in sizes for x in l])
                src = np.repeat(np.arange(m), k)
                parts = kk_partition(verl, np.concatenate([np.asarray(c, float) for c in cost]), m, True)
                dest = np.empty(m * k, dtype=int)
                for i, part in enumerate(parts):
                    dest[part] = i
                mv = dest != src
                inter = mv & (dest // RPN != src // RPN)
                acc["kk"].append((flat_size[mv & ~inter].sum() / total, flat_size[inter].sum() / total))

        def cell(v):
            if not v:
                return "n/a"
            i, e = statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v)
            return f"{100 * (i + e):.0f}% ({100 * i:.0f} / {100 * e:.0f})"
        print(f"| {m} x {k} | " + " | ".join(cell(acc[c]) for c in ("ln", "la", "pn", "pa", "mm", "kk")) + " |")
    print()
    print(f"runtime: {time.perf_counter() - t_start:.1f} s ({'quick' if a.quick else 'full'})")


if __name__ == "__main__":
    main()
