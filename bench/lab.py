"""One row of the main table: every method's schedule for a (workload, model, setting), priced.

`Lab` builds each schedule once (and checks its ledger) and reduces it to features once, so
the settings, calibration and ablations that share a world size share the schedules.
`evaluate_row` is the unit the report is made of: one workload under one model and setting.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from odb_factory.balance import StageCostModel

from . import methods as M
from . import paper, peers
from .simulate import Features, Result, check_ledger, evaluate, explain, features
from .step_model import H20_1NODE, H20_2NODES, MODELS, StepModel, build_step_model
from .workloads import Profile

SETTINGS = {
    "1n-full": ("1 node · full FT", H20_1NODE, "full"),
    "1n-lora": ("1 node · LoRA", H20_1NODE, "lora"),
    "2n-full": ("2 nodes · full FT", H20_2NODES, "full"),
}
BUFFER = 256                       # ODB window B (odb_factory's default)
# How packed rows attend, each priced as it runs: "segments" (flash varlen, or the per-segment
# sdpa odb_factory registers: sum len**2), "mask" (sdpa/eager over a dense block-causal mask:
# (sum len)**2). Padded batches cost the same under both.
BACKENDS = ("segments", "mask")


def step_model_for(model: str, setting: str, mfu: float) -> StepModel:
    _, hw, mode = SETTINGS[setting]
    return build_step_model(MODELS[model], hw, mode, mfu=mfu)


class Lab:
    """Builds each schedule once and its features once; evaluates under any step model."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.schedules: Dict[tuple, Optional[M.Schedule]] = {}
        self.feats: Dict[tuple, Features] = {}

    def schedule(self, key: tuple, build, n: int) -> Optional[M.Schedule]:
        """Build once; every schedule passes the ledger check (n samples) before use."""
        if key not in self.schedules:
            s = build()
            if s is not None:
                check_ledger(s, n)
            self.schedules[key] = s
        return self.schedules[key]

    def features(self, key: tuple, p: Profile, packed_attention: str = "segments") -> Optional[Features]:
        """`packed_attention` prices packed rows by the attention that runs ('segments': flash
        varlen or per-segment sdpa; 'mask': a dense block-causal mask); padded batches alike."""
        s = self.schedules.get(key)
        if s is None:
            return None
        if s.cost_mode != "packed":
            packed_attention = "segments"
        if (key, packed_attention) not in self.feats:
            self.feats[key, packed_attention] = features(s, p, packed_attention)
        return self.feats[key, packed_attention]


def common_schedules(lab: Lab, p: Profile, world: int, only=None) -> Dict[str, tuple]:
    """Schedules that depend only on the profile and the world size (`only`: a subset)."""
    seed, b = lab.seed, p.token_budget
    keys = {}

    def add(name, build):
        if only is not None and name not in only and name != "odb":
            return
        key = (name, p.name, world)
        lab.schedule(key, build, len(p))
        keys[name] = key

    add("standard", lambda: M.standard(p, world, 1, seed))
    add("odb", lambda: M.odb(p, world, b, True, BUFFER, seed))
    add("odb_nonjoin", lambda: M.odb(p, world, b, False, BUFFER, seed))
    add("odb_pf", lambda: M.odb(p, world, b, True, BUFFER, seed, cost_mode="packed", name="odb_pf"))
    add("odb_global", lambda: M.odb(p, world, b, True, BUFFER, seed, name="odb_global", global_grouping=True))
    add("odb_pf_global", lambda: M.odb(p, world, b, True, BUFFER, seed, cost_mode="packed", name="odb_pf_global",
                                       global_grouping=True))
    add("gmt", lambda: M.gmt(p, world, b, seed))
    add("gmt_ordered", lambda: M.gmt(p, world, b, seed, shuffle=False))
    add("bmt", lambda: M.bmt(p, world, b, seed))
    add("bmt_ordered", lambda: M.bmt(p, world, b, seed, shuffle=False))
    if p.text_only:
        add("packing", lambda: M.packing(p, world, b, seed))
        add("packing_ordered", lambda: M.packing(p, world, b, seed, shuffle=False))
    add("peer", lambda: M.peer(p, world, b, BUFFER, seed))
    if only is not None and "standard_matched" not in only:
        return keys
    odb = lab.schedules[keys["odb"]]
    per_rank_step = len(p) / (odb.micro_steps * world)
    ga = max(1, round(per_rank_step))
    add("standard_matched", lambda: M.standard(p, world, 1, seed, accumulation=ga,
                                               name="standard_matched"))
    return keys


def batch_schedules(lab: Lab, p: Profile, world: int, bs: int, only=None) -> Dict[str, tuple]:
    """Fixed-batch schedules at the OOM-safe per-device batch `bs`."""
    seed, keys = lab.seed, {}
    for name, build in (("sorted", lambda: M.sorted_by_length(p, world, bs)),
                        ("sorted_shuffled", lambda: M.sorted_shuffled(p, world, bs, seed)),
                        ("group_by_length", lambda: M.group_by_length(p, world, bs, seed))):
        if only is not None and name not in only:
            continue
        key = (name, p.name, world, bs)
        lab.schedule(key, build, len(p))
        keys[name] = key
    if bs != 1 and (only is None or "standard_safe" in only):
        key = ("standard_safe", p.name, world, bs)
        lab.schedule(key, lambda: M.standard(p, world, bs, seed, name="standard_safe"), len(p))
        keys["standard_safe"] = key
    return keys


def peer_schedules(lab: Lab, p: Profile, world: int, m: StepModel, model: str, mode: str,
                   odb_pf: M.Schedule) -> Dict[str, tuple]:
    """The strong padding-free peers (bench.peers). verl's global batch holds as many samples as
    padding-free ODB's optimizer steps do on average (a multiple of the world size), so both take
    about as many optimizer steps; the packers' window is ODB's (world x B samples) or the epoch."""
    seed, b, keys = lab.seed, p.token_budget, {}
    global_batch = max(world, round(len(p) / odb_pf.optimizer_steps / world) * world)
    cost = peers.sample_seconds_of(p, m)
    builds = {
        "verl": (("verl", p.name, world, global_batch),
                 lambda: peers.verl_dynamic(p, world, b, global_batch, seed)),
        "verl_windows": (("verl_windows", p.name, world, global_batch),
                         lambda: peers.verl_dynamic(p, world, b, global_batch, seed, sorted_windows=True)),
        "window_pack": (("window_pack", p.name, world, model, mode),
                        lambda: peers.window_pack(p, world, b, world * BUFFER, cost, m.fits, seed)),
        "epoch_pack": (("epoch_pack", p.name, world, model, mode),
                       lambda: peers.window_pack(p, world, b, len(p), cost, m.fits, seed, name="epoch_pack")),
    }
    for name, (key, build) in builds.items():
        if lab.schedule(key, build, len(p)) is not None:
            keys[name] = key
    if not p.text_only and "epoch_pack" in keys:
        source = keys["epoch_pack"]
        key2 = ("epoch_pack_2stage",) + source[1:]
        lab.schedule(key2, lambda: M.Schedule(
            "epoch_pack_2stage", world, lab.schedules[source].steps, cost_mode="packed",
            note=lab.schedules[source].note + " + encoder stage", extra={"encoder_balanced": True}), len(p))
        keys["epoch_pack_2stage"] = key2
    return keys


def engine_vision_cost(m: StepModel) -> StageCostModel:
    """The vision encoder's cost from a sample's patch total, as the loader's post-balancing
    prices it (no per-image attention term, see balance/cost_model.py VISION_BY_PATCH_TOTAL),
    with the step model's coefficients; its per-image constant counted once per sample."""
    return StageCostModel(c0=m.v0, a=m.va, b=0.0)


def limit_result(r: Result) -> Result:
    """The limit for a padding-free schedule: every step's work (its padding-free LLM and vision
    cost, per-rank constants included) spread perfectly over the ranks, max = mean, with the same
    micro-steps, optimizer steps and fixed costs."""
    time_s = r.mean_rank_s + r.fixed_s
    return dataclasses.replace(
        r, method="limit", time_s=time_s, samples_per_s=None if r.oom else r.samples / time_s,
        tokens_per_s=None if r.oom else r.tokens_per_s * r.time_s / time_s, padding_ratio=0.0,
        max_over_lb=1.0, max_over_mean=1.0, max_rank_s=r.mean_rank_s,
        note=f"{r.method}'s work, perfectly balanced")


def evaluate_row(lab: Lab, p: Profile, model: str, setting: str, mfu: float) -> dict:
    """Every method on one workload under one model and setting, with the paper's figure and
    the decomposition that explains the difference (`simulate.explain`) where there is one."""
    label, hw, mode = SETTINGS[setting]
    m = step_model_for(model, setting, mfu)
    world = hw.world
    bs = max(1, m.safe_batch(int(p.tokens.max()), int(p.patches.max())))
    keys = {**common_schedules(lab, p, world), **batch_schedules(lab, p, world, bs)}
    vision = engine_vision_cost(m)

    def balanced(name: str, source: str, mode_: str, encoder_stage: bool = False) -> None:
        """`source` post-balanced (padded: under the memory cap; lpt: the packed plan_step,
        vision priced with the sample unless the encoder stage balances it on its own)."""
        if source not in keys or (encoder_stage and p.text_only):
            return
        key = (name, p.name, world, model, mode)
        if encoder_stage and mode_ == "padded":  # the same plan as without the stage: reuse it
            plain = lab.schedules[keys[f"{source}_balanced"]]
            build = lambda: dataclasses.replace(  # noqa: E731
                plain, method=name, note=plain.note + " + encoder stage", extra={**plain.extra, "encoder_balanced": True})
        else:
            build = lambda: M.post_balance(  # noqa: E731
                lab.schedules[keys[source]], p, m.token_cost, m.cap_tokens, hw.gpus_per_node, mode=mode_,
                encoder_stage=encoder_stage, vision_cost=None if encoder_stage else vision)
        lab.schedule(key, build, len(p))
        keys[name] = key

    for source in ("odb", "odb_global"):
        balanced(f"{source}_balanced", source, "padded")
        balanced(f"{source}_balanced_2stage", source, "padded", encoder_stage=True)
    for source in ("odb_pf", "odb_pf_global"):
        balanced(f"{source}_balanced", source, "lpt")
        balanced(f"{source}_balanced_2stage", source, "lpt", encoder_stage=True)
    if not p.text_only:
        tkey = ("gmt_textcache", p.name, world, m.cap_tokens)
        if tkey not in lab.schedules:
            budget, sched = M.tune_text_cache_budget(p, world, p.token_budget, m.fits, M.gmt, lab.seed)
            if sched is not None:
                check_ledger(sched, len(p))
                sched.note = f"text-only cache, budget tuned OOM-free: {budget}"
            lab.schedules[tkey] = sched
        keys["gmt_textcache"] = tkey
    keys.update(peer_schedules(lab, p, world, m, model, mode, lab.schedules[keys["odb_pf"]]))
    by_backend = {}
    for backend in BACKENDS:
        results = {}
        for name, key in keys.items():
            f = lab.features(key, p, backend)
            if f is not None:
                results[name] = evaluate(f, p, m)
        if "odb_pf_global" in results:
            results["limit"] = limit_result(results["odb_pf_global"])
        by_backend[backend] = results
    results = by_backend["segments"]
    bounds = {"L_max": peers.lower_bound(p, m, world, p.token_budget, "L_max"),
              "memory cap": peers.lower_bound(p, m, world, m.cap_tokens, "memory cap")}
    fig = paper.figure_for(p.name, model, setting)
    row = {"workload": p.name, "model": model, "setting": setting, "setting_label": label,
           "cv": p.cv, "f_s": p.short_fraction, "results": results, "paper": fig, "safe_bs": bs,
           "results_by_backend": by_backend, "bounds": bounds,
           "exchange_s": peers.exchange_seconds(p, MODELS[model].hidden, hw.busbw, world),
           "ga_matched": lab.schedules[keys["standard_matched"]].accumulation,
           "fixed_per_step_ms": (m.comm_micro_s + m.comm_opt_s + m.optimizer_s) * 1e3,
           "comm_per_step_ms": (m.comm_micro_s + m.comm_opt_s) * 1e3,
           "busbw_GBs": hw.busbw / 1e9,
           "step_model": m, "notes": [], "keys": keys}
    if fig is not None:
        row["explain"] = explain(lab.features(keys["standard"], p), lab.features(keys["odb"], p),
                                 p, m, fig.odb_speedup, fig.standard_sps)
    return row
