"""Writes bench/results/: report.md, the CSVs and the plots, from what bench.run computed.

The sentences that sum up an ablation are computed from its rows, like every verdict in
bench.paper_comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

from . import paper_comparison as cmp
from . import plots
from .ablations import PREP_IMAGE_S, PREP_TEXT_S, WORKERS
from .lab import BUFFER, SETTINGS, step_model_for
from .paper import TOLERANCE_TEXT
from .step_model import describe
from .tables import (detail_rows, detail_table, main_table, md_table, peer_summary, peer_table,
                     standing_summary, standing_table,
                     variant_rows, write_csv)
from .workloads import Profile

FULL_OVERLAP = 0.99   # steady-state overlap that counts as "the trainer never waits"


@dataclass
class BenchResults:
    """Everything one `python -m bench.run` computed."""
    rows: List[dict]                  # bench.lab.evaluate_row, one per (workload, model, setting)
    profiles: Dict[str, Profile]
    lmax: List[dict]
    buffer_rows: List[dict]
    depth: List[dict]
    cv_rows: List[dict]
    fs_rows: List[dict]
    engine_md: str
    measured_md: str
    mfu: float
    samples: int
    quick: bool
    omni_md: str = ""                 # bench.audio_stage: encoder stages on an omni profile
    sensitivity_md: str = ""          # bench.sensitivity: bands over the uncertain inputs

    @property
    def headline(self) -> List[dict]:
        return [r for r in self.rows if is_headline(r)]


def is_headline(row: Mapping) -> bool:
    """The main table's rows: Qwen3-VL-8B, 1 node, full FT."""
    return row["model"] == "8B" and row["setting"] == "1n-full"


def step_model_rows(mfu: float) -> List[dict]:
    return [{"setting": setting, **describe(step_model_for(model, setting, mfu))}
            for setting in SETTINGS for model in ("8B", "2B")]


def write_tables_and_plots(out: Path, res: BenchResults) -> None:
    write_csv(out / "methods.csv", detail_rows(res.rows))
    write_csv(out / "profiles.csv", [p.summary() for p in res.profiles.values()])
    write_csv(out / "step_models.csv", step_model_rows(res.mfu))
    write_csv(out / "ablation_lmax.csv", res.lmax)
    write_csv(out / "ablation_buffer.csv", res.buffer_rows)
    write_csv(out / "ablation_depth.csv", res.depth)
    write_csv(out / "sweep_cv.csv", res.cv_rows)
    write_csv(out / "sweep_fs.csv", res.fs_rows)
    write_csv(out / "paper_vs_ours.csv", [
        {"workload": r["workload"], "model": r["model"], "setting": r["setting"], **r["explain"]}
        for r in res.rows if r.get("paper")])
    plots.plot_speedup_bars(res.rows, out / "speedup_bars_8B_1node.png")
    plots.plot_speedup_bars(res.rows, out / "speedup_bars_2B_2nodes.png", "2n-full", "2B")
    plots.plot_sweeps(res.cv_rows, res.fs_rows, out / "speedup_vs_cv_fs.png")
    plots.plot_lines(res.lmax, "L_max", "speedup", "workload", out / "ablation_lmax.png",
                     "token budget L_max", "ODB speedup vs Standard bs=1")
    plots.plot_lines(res.depth, "D", "overlap", "case", out / "ablation_depth.png",
                     "outstanding depth D", "steady-state overlap (1 - data wait after step 1)",
                     logx=True)


# ----------------------------------------------------------------------------- ablation text
def _by(rows: Sequence[Mapping], key: str) -> Dict[str, List[Mapping]]:
    groups: Dict[str, List[Mapping]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


def lmax_text(lmax: Sequence[Mapping]) -> str:
    if not lmax:
        return "No L_max rows."
    cap = lmax[0]["cap_tokens"]
    first_oom = {w: min((r["L_max"] for r in rs if r["oom_batches"]), default=None)
                 for w, rs in _by(lmax, "workload").items()}
    oom = [f"{w} from {b}" for w, b in first_oom.items() if b is not None]
    never = [w for w, b in first_oom.items() if b is None]
    below_cap = [w for w, b in first_oom.items() if b is not None and b <= cap]
    text = (f"Memory cap of one micro-batch: {cap} padded tokens. Budgets with OOM batches "
            "(reported, not counted): " + ("; ".join(oom) if oom else "none")
            + (f"; no OOM at any budget for {', '.join(never)}" if oom and never else "") + ".")
    if below_cap:
        text += (f" {', '.join(below_cap)} OOM at or below the cap: their vision patches take "
                 "memory too.")
    return text + " Plot: `ablation_lmax.png`."


def window_text(buffer_rows: Sequence[Mapping]) -> str:
    text = "Samples a rank sorts together before grouping."
    cases = _by(buffer_rows, "case")
    if not cases:
        return text
    ends = {c: (min(rs, key=lambda r: r["B"]), max(rs, key=lambda r: r["B"])) for c, rs in cases.items()}
    small_b, large_b = next(iter(ends.values()))[0]["B"], next(iter(ends.values()))[1]["B"]
    pads_more = [c for c, (s, l) in ends.items() if s["padding_ratio"] > l["padding_ratio"]]
    text += (f" Padding ratio at B={small_b} → B={large_b}: "
             + ", ".join(f"{c} {s['padding_ratio']:.3f} → {l['padding_ratio']:.3f}" for c, (s, l) in ends.items())
             + f". The smallest window pads more than the largest in {len(pads_more)} of {len(ends)} cases.")
    gains = {}
    for c, rs in cases.items():
        ours, largest = next((r for r in rs if r["B"] == BUFFER), None), ends[c][1]
        if ours and ours["samples_per_s"] and largest["samples_per_s"]:
            gains[c] = largest["samples_per_s"] / ours["samples_per_s"] - 1
    if gains:
        best = max(gains, key=lambda c: abs(gains[c]))
        text += (f" Largest change from our B={BUFFER} to B={large_b}: {best}, "
                 f"{gains[best]:+.0%} samples/s.")
    return text


def depth_text(depth: Sequence[Mapping]) -> str:
    text = (f"Workers prepare samples ({WORKERS}/rank; {PREP_TEXT_S * 1e3:.0f} ms + "
            f"{PREP_IMAGE_S * 1e3:.0f} ms per image, assumptions) and may run "
            "2×workers ahead; each ODB round refills the window B and aligns, then its slots enter a "
            "queue of depth D. The second producer is set to only 1.5× the trainer's sample rate "
            "(heavy augmentation, few CPU cores per GPU). `data_wait_fraction` counts all "
            "trainer idle time incl. the first window's fill (`startup_s`, paid by any loader); "
            "`overlap` is the steady state after the first step.")
    firsts = []
    for case, rs in _by([{**r, "row": f"{r['workload']} {r['model']} {r['setting']}"} for r in depth],
                        "row").items():
        reached = []
        for producer, ps in _by(rs, "producer").items():
            full = [r["D"] for r in ps if r["overlap"] >= FULL_OVERLAP]
            reached.append(f"{producer} D={min(full)}" if full
                           else f"{producer} not up to D={max(r['D'] for r in ps)}")
        firsts.append(f"{case} ({rs[0]['slots_per_round']:.1f} slots per round): " + ", ".join(reached))
    if firsts:
        text += f" Smallest D with steady-state overlap ≥ {FULL_OVERLAP}: " + "; ".join(firsts) + "."
    return text + (" D in {1, 2, 4, 16, 64} shown; all D in `ablation_depth.csv`, plot "
                   "`ablation_depth.png`.")


PEERS_INTRO = (
    "Peers (bench/peers.py, every one padding-free under the same L_max, ledger-checked): verl's "
    "dynamic batch size as verl ships it (its own `get_seqlen_balanced_partitions` and "
    "`rearrange_micro_batches`, from the installed package; its global batch as large as padding-free "
    "ODB's optimizer steps on average), the same over length-sorted windows of 16 global batches, a "
    "window packer with ODB's information (world × B samples packed, dealt in workload order, each step "
    "re-split across ranks by Karmarkar-Karp), and the same over the whole epoch with the length cache "
    "LLaMA-Factory's preprocessed dataset holds (+ the encoder stage on multimodal rows). GMT, BMT and "
    "Packing are ranked dealt shuffled and dealt in workload order. *At ODB's information*: methods that "
    "see a window at a time; *with the epoch cache*: methods that read every length of the epoch first "
    "(sorted, group_by_length, GMT, BMT, Packing, the epoch packer). The **lower bound** belongs to no "
    "method: every sample's padding-free cost spread perfectly over the ranks, plus the fixed costs of "
    "the fewest micro-steps L_max (or the memory cap) allows, one optimizer step each. Each backend "
    "prices packed rows by the attention that runs: Σ len² per sample, or (Σ len)² through the mask "
    "(`odb_padding_free_row_tokens` rows are not priced here); padded batches cost the same under both.")
UNPRICED_EXCHANGES = (
    "Not priced: the sample exchange of global grouping and post-balancing (token ids, labels and "
    "pixel values of the samples that change rank, once per round or step) and the encoder stage's "
    "embedding exchange; both overlap the previous step in the loader. The column *unpriced exchange ≤* "
    "bounds them from above (every sample of the epoch moved once at the hardware model's bus "
    "bandwidth, nothing overlapped, as a share of the fastest ODB variant's time): a row whose margin "
    "over the next method is larger than that share keeps its ranking. `python -m bench.balance_bench` "
    "measures the bytes actually moved per step.")


# ----------------------------------------------------------------------------- report.md
def report_markdown(res: BenchResults) -> str:
    side = [r for r in res.rows if r.get("paper")]
    explain_md = [cmp.explanation(r) for r in side if cmp.needs_explanation(r)]
    others = [r for r in res.rows if not is_headline(r)]
    models = step_model_rows(res.mfu)
    md = [
        "# Throughput: the papers' tables side by side (simulation layer)",
        f"Mode: {'quick' if res.quick else 'full'}, {res.samples:,} samples per profile, seed fixed. Every "
        "method's batches come from its real code path (bench/methods.py); a step-time model "
        "(bench/step_model.py) prices them on 8×H20 / 2×8×H20. Metric: all-rank emitted samples / "
        "simulated wall-clock train time. Speedups are vs Standard with per-device batch 1 (the "
        f"paper's baseline). Calibrated matmul efficiency (the one number fitted to the paper, "
        f"on the Standard samples/s of UltraChat and LLaVA, 8B): **MFU = {res.mfu:.3f}**. "
        "Assumptions and sources: bench/README.md.",
        "## Main table — Qwen3-VL-8B, 1 node, full FT (samples/s and speedup)",
        main_table(res.headline),
        "## Where ODB stands, every row (computed)",
        "Fastest ODB variant against the fastest other method of the same row (OOM excluded; the "
        "limit is a bound, not a method): padded ODB's padding share and max/LB after "
        "post-balancing, and padding-free ODB against the limit (its own work perfectly balanced, "
        "the same fixed costs).", "",
        standing_summary(res.rows), "",
        md_table(variant_rows(res.rows), [(k, k) for k in ("ODB variant", "lowest", "highest", "rows ≥ 0.99×")]),
        "", standing_table(res.rows),
        "## Against the strongest peers, per attention backend (computed)",
        PEERS_INTRO, "",
        "### Packed rows attend per sample (flash varlen, or odb_factory's per-segment sdpa)",
        peer_summary(res.rows, "segments"), "", peer_table(res.rows, "segments"), "",
        "### Packed rows attend through a dense block-causal mask (sdpa/eager, `odb_packed_attention: mask`)",
        peer_summary(res.rows, "mask"), "", peer_table(res.rows, "mask"), "",
        UNPRICED_EXCHANGES,
        "## Paper figures beside ours",
        cmp.paper_side_by_side(res.rows), "", cmp.range_check(res.rows),
        cmp.oracle_summary(res.rows),
        "## Sensitivity: every speedup over its uncertain inputs (bench.sensitivity)",
        res.sensitivity_md or "Not computed in this run.",
        "## Why rows differ from the paper (computed)",
        "\n\n".join(explain_md) if explain_md else f"All paper rows are within {TOLERANCE_TEXT}.",
        "## All settings (samples/s and speedup)",
        main_table(others),
        "## Per-method details — 8B, 1 node, full FT",
        "Real tokens/s, padding ratio (padded-but-empty share of LLM tokens computed), optimizer "
        "steps, max/LB (Σ step maxima / Σ per-step lower bounds), OOM batches, peak padded tokens "
        "per rank. All rows and settings: `methods.csv`.", "",
        detail_table(res.rows),
        "## Step models",
        md_table(models, [(k, k) for k in models[0].keys()]),
        "## Profiles",
        md_table([p.summary() for p in res.profiles.values()],
                 [("profile", "profile"), ("samples", "n"), ("mean_tokens", "mean tok"),
                  ("p50", "p50"), ("p99", "p99"), ("max", "max"), ("cv", "CV"),
                  ("f_s", "f_s"), ("images_per_sample", "img/sample"),
                  ("patches_per_image", "patches/img"), ("vision_token_share", "vision share"),
                  ("token_budget", "L_max")]),
        "## Ablation: token budget L_max (8B, 1 node, full FT)",
        lmax_text(res.lmax), "",
        md_table(res.lmax, [(k, k) for k in ("workload", "L_max", "samples_per_s", "speedup",
                                              "oom_batches", "padding_ratio", "optimizer_steps",
                                              "max_over_lb")]),
        "## Ablation: window B",
        window_text(res.buffer_rows), "",
        md_table(res.buffer_rows, [(k, k) for k in ("case", "B", "samples_per_s", "speedup",
                                                     "padding_ratio", "optimizer_steps",
                                                     "max_over_lb")]),
        "## Ablation: outstanding depth D (producer/consumer model)",
        depth_text(res.depth), "",
        md_table([r for r in res.depth if r["D"] in (1, 2, 4, 16, 64)],
                 [(k, k) for k in ("case", "D", "slots_per_round", "data_wait_fraction",
                                   "startup_s", "overlap", "samples_per_s",
                                   "prep_ms_per_sample")]),
        "## Speedup vs length CV and vs short-sample fraction f_s (generated profiles)",
        "Plot: `speedup_vs_cv_fs.png`.", "",
        md_table(res.cv_rows, [(k, k) for k in res.cv_rows[0].keys() if k != "profile"]), "",
        md_table(res.fs_rows, [(k, k) for k in res.fs_rows[0].keys() if k != "profile"]),
    ]
    if res.measured_md:
        md.append(res.measured_md)
    else:
        md += ["## Measured layer",
               "No measured rows yet. Put per-micro-batch measurements in "
               "`bench/results/measured_rows.csv` (columns tokens, sum_sq, images, patches, "
               "patch_sq, time_s; optional label) or pass `--measured PATH`; "
               "`bench.measured_report.add_measured_rows(rows, out_dir)` fits the step model to "
               "them and adds the predicted-vs-measured table and plot."]
    if res.omni_md:
        md += ["## Encoder stages on an omni profile (bench.audio_stage, synthetic)", res.omni_md]
    if res.engine_md:
        md += ["## Engine benchmark (bench.engine)", res.engine_md]
    return "\n\n".join(md) + "\n"


def write_report(out: Path, res: BenchResults) -> str:
    write_tables_and_plots(out, res)
    text = report_markdown(res)
    (out / "report.md").write_text(text)
    return text
