"""Ablations of the simulation layer: token budget L_max, window B, outstanding depth D, and
the speedup against length CV and short-sample fraction f_s on generated workloads."""

from __future__ import annotations

from typing import Dict, List

from . import methods as M
from . import workloads as W
from .lab import BUFFER, SETTINGS, Lab, batch_schedules, common_schedules, step_model_for
from .simulate import data_wait, evaluate, features, rounds_of, step_times
from .workloads import Profile

LMAX_BUDGETS = [4096, 8192, 12288, 14336, 16384, 20480, 24576, 32768]
WINDOWS = [64, 256, 1024, 4096]
DEPTHS = [1, 2, 4, 8, 16, 32, 64]
SWEEP_CVS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
SWEEP_SHORT_FRACTIONS = (0.0, 0.2, 0.4, 0.6, 0.8)
PREP_TEXT_S, PREP_IMAGE_S = 0.002, 0.025   # per-sample pipeline cost in a worker (assumption)
WORKERS = 4                                # DataLoader workers per rank (assumption)


def ablation_lmax(lab: Lab, profiles: Dict[str, Profile], mfu: float,
                  budgets=LMAX_BUDGETS) -> List[dict]:
    """ODB at other token budgets (8B, 1 node): budgets past the memory cap OOM."""
    m = step_model_for("8B", "1n-full", mfu)
    rows = []
    for name, p in profiles.items():
        fs = lab.features(("standard", p.name, 8), p)
        base = evaluate(fs, p, m).samples_per_s
        for b in budgets:
            s = M.odb(p, 8, b, True, BUFFER, lab.seed)
            r = evaluate(features(s, p), p, m)
            rows.append({"workload": name, "L_max": b, "samples_per_s": r.samples_per_s,
                         "speedup": r.samples_per_s / base if r.samples_per_s else None,
                         "oom_batches": r.oom_batches, "padding_ratio": r.padding_ratio,
                         "optimizer_steps": r.optimizer_steps, "max_over_lb": r.max_over_lb,
                         "cap_tokens": m.cap_tokens})
    return rows


def ablation_cases(profiles: Dict[str, Profile], mfu: float):
    """The rows the window and depth ablations cover: every workload on 8B/1 node, and MM-Mix
    on 2B/2 nodes, with the step model of each."""
    cases = [(name, "8B", "1n-full") for name in profiles] + [("MM-Mix", "2B", "2n-full")]
    for name, model, setting in cases:
        if name in profiles:
            hw = SETTINGS[setting][1]
            yield name, model, setting, profiles[name], hw, step_model_for(model, setting, mfu)


def ablation_buffer(lab: Lab, profiles: Dict[str, Profile], mfu: float,
                    buffers=WINDOWS) -> List[dict]:
    """ODB window B: a larger window sorts more samples together (less padding, fuller groups)
    but delays the first step and holds more samples; matters when groups hold many samples."""
    rows = []
    for name, model, setting, p, hw, m in ablation_cases(profiles, mfu):
        common_schedules(lab, p, hw.world, only=("standard",))
        base = evaluate(lab.features(("standard", p.name, hw.world), p), p, m).samples_per_s
        for b in buffers:
            key = ("odb", p.name, hw.world) if b == BUFFER else ("odb_B", p.name, hw.world, b)
            lab.schedule(key, lambda: M.odb(p, hw.world, p.token_budget, True, b, lab.seed), len(p))
            r = evaluate(lab.features(key, p), p, m)
            rows.append({"case": f"{name} {model} {setting}", "workload": name, "model": model,
                         "setting": setting, "B": b, "samples_per_s": r.samples_per_s,
                         "speedup": r.samples_per_s / base if r.samples_per_s else None,
                         "padding_ratio": r.padding_ratio, "optimizer_steps": r.optimizer_steps,
                         "max_over_lb": r.max_over_lb})
    return rows


def ablation_depth(lab: Lab, profiles: Dict[str, Profile], mfu: float,
                   depths=DEPTHS) -> List[dict]:
    """D sweep under two producers: the default workers, and a tight one whose sample rate is
    only 1.5x the trainer's (where window-boundary stalls can appear)."""
    rows = []
    for name, model, setting, p, hw, m in ablation_cases(profiles, mfu):
        key = ("odb", p.name, hw.world)
        common_schedules(lab, p, hw.world, only=("odb",))
        s = lab.schedules[key]
        t = step_times(lab.features(key, p), m)
        round_of, need = rounds_of(s, BUFFER)
        consume = len(p) / hw.world / float(t.sum())       # samples per rank per second
        default = PREP_TEXT_S + PREP_IMAGE_S * float(p.images.mean())
        for producer, prep in (("default producer", default),
                               ("producer 1.5x trainer", WORKERS / (1.5 * consume))):
            for d in depths:
                w = data_wait(t, round_of, need, d, prep, WORKERS)
                rows.append({"case": f"{name} {model} {setting}, {producer}", "workload": name,
                             "model": model, "setting": setting, "producer": producer, "D": d,
                             "B": BUFFER, "slots_per_round": float(len(t) / max(1, len(need))),
                             "data_wait_fraction": w.wait_fraction, "startup_s": w.startup_s,
                             "overlap": w.overlap,
                             "samples_per_s": len(p) / (w.train_s + w.wait_s),
                             "prep_ms_per_sample": prep * 1e3, "workers": WORKERS})
    return rows


def sweep(profiles_: List[Profile], key: str, mfu: float, lab: Lab) -> List[dict]:
    """Speedup vs Standard bs=1 of ODB, GMT and Sorted (8B, 1 node) and of ODB (2B, 2 nodes)
    on each generated profile; `key` names the swept statistic ("cv" or "f_s")."""
    rows = []
    for p in profiles_:
        row = {key: round(p.cv if key == "cv" else p.short_fraction, 3), "profile": p.name,
               "cv": p.cv, "f_s": p.short_fraction, "mean_tokens": float(p.tokens.mean())}
        for model, setting, suffix in (("8B", "1n-full", ""), ("2B", "2n-full", "_2b_2n")):
            hw = SETTINGS[setting][1]
            m = step_model_for(model, setting, mfu)
            keys = common_schedules(lab, p, hw.world, only=("standard", "odb", "gmt"))
            bs = max(1, m.safe_batch(int(p.tokens.max())))
            keys.update(batch_schedules(lab, p, hw.world, bs, only=("sorted",)))
            base = evaluate(lab.features(keys["standard"], p), p, m).samples_per_s
            for method in ("odb", "gmt", "sorted") if not suffix else ("odb",):
                r = evaluate(lab.features(keys[method], p), p, m)
                row[f"x_{method}{suffix}"] = r.samples_per_s / base if r.samples_per_s else None
        rows.append(row)
    return rows


def sweep_cv(lab: Lab, n: int, mfu: float) -> List[dict]:
    return sweep([W.generated_cv(n, c, seed=lab.seed) for c in SWEEP_CVS], "cv", mfu, lab)


def sweep_short_fraction(lab: Lab, n: int, mfu: float) -> List[dict]:
    return sweep([W.generated_fs(n, f, seed=lab.seed) for f in SWEEP_SHORT_FRACTIONS], "f_s", mfu, lab)
