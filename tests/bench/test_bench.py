"""Correctness of the benchmark's simulation layer (bench/): workloads, methods, step model.

Fast (a few seconds): small profiles, 4-8 simulated ranks. The full `python -m bench.run`
smoke runs separately; here one tiny end-to-end row is simulated.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from bench import demo_workload, measured_report, peers, tables
from bench import methods as M
from bench import workloads as P
from bench.methods import Schedule
from bench.simulate import (LedgerError, check_ledger, data_wait, evaluate, features, rounds_of,
                            step_times)
from bench.step_model import (H20_1NODE, H20_2NODES, QWEN3_VL_2B, QWEN3_VL_8B,
                              build_step_model, fit_step_model)

M8 = build_step_model(QWEN3_VL_8B, H20_1NODE, "full", mfu=0.7)


@pytest.fixture(scope="module")
def small():
    return {"text": P.ultrachat(1600, seed=3), "image": P.sharegpt4o(1600, seed=3),
            "mix": P.mm_mix(1600, seed=3)}


# ----------------------------------------------------------------------------- profiles
@pytest.mark.parametrize("make,cv,mean", [(P.ultrachat, 0.48, 1350), (P.llava, 0.29, 540),
                                          (P.sharegpt4o, 1.00, 2000)])
def test_paper_profiles_hit_their_targets(make, cv, mean):
    p = make(8000, seed=1)
    assert abs(p.cv - cv) < 0.02
    assert abs(p.tokens.mean() / mean - 1) < 0.02
    assert p.tokens.max() <= P.CUTOFF_LEN and p.tokens.min() > 0
    assert np.all(p.text_tokens + p.patches // 4 == p.tokens)


def test_mm_mix_has_high_short_fraction_and_lower_cv_than_sharegpt4o():
    p = P.mm_mix(40000, seed=0)
    assert abs(p.cv - 0.95) < 0.05 and p.cv < 1.0
    assert p.short_fraction > 0.55
    assert P.sharegpt4o(8000).short_fraction < 0.1


def test_generated_sweeps_hit_cv_and_short_fraction():
    for cv in (0.3, 1.2):
        assert abs(P.generated_cv(4000, cv).cv - cv) < 0.02
    lo, hi = P.generated_fs(4000, 0.1).short_fraction, P.generated_fs(4000, 0.7).short_fraction
    assert lo < 0.2 and hi > 0.6


def test_image_grid_matches_lf_shrink_then_transformers_smart_resize():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    for w, h in [(640, 480), (300, 168), (4000, 3000), (1024, 768), (200, 120), (768, 768)]:
        ww, hh = w, h
        if w * h > P.IMAGE_MAX_PIXELS:
            f = math.sqrt(P.IMAGE_MAX_PIXELS / (w * h))
            ww, hh = int(w * f), int(h * f)
        rh, rw = smart_resize(hh, ww, 32, P.PROC_MIN_PIXELS, P.PROC_MAX_PIXELS)
        assert P.image_grid(w, h) == (rh // 16, rw // 16)
    assert P.image_patches(768, 768) == 2304          # 576 LLM tokens at the cap


def test_profile_from_rows_plugs_a_real_dataset():
    p = P.profile_from_rows("mine", [(100, 0, 0), (700, 1, 2304), (20000, 2, 400)])
    assert list(p.tokens) == [100, 700, P.CUTOFF_LEN]
    assert list(p.text_tokens) == [100, 700 - 576, P.CUTOFF_LEN - 100]
    assert p.patch_sq[2] == 2 * 200 ** 2 and not p.text_only
    with pytest.raises(ValueError):
        P.profile_from_rows("bad", [(0, 0, 0)])


def test_demo_profile_reads_the_real_demo_sets():
    if not demo_workload.DEMO_DIR.exists():
        pytest.skip(f"LLaMA-Factory demo data not found at {demo_workload.DEMO_DIR}")
    p = demo_workload.demo_profile()
    assert len(p) >= 1300 and p.images.sum() > 0 and p.tokens.min() > 0


# ----------------------------------------------------------------------------- methods
def _all_schedules(p, world=4, bs=2):
    b = p.token_budget
    out = [M.standard(p, world, bs), M.standard(p, world, 1, accumulation=3, name="standard_matched"),
           M.sorted_by_length(p, world, bs), M.sorted_shuffled(p, world, bs),
           M.group_by_length(p, world, bs), M.gmt(p, world, b), M.bmt(p, world, b),
           M.gmt(p, world, b, cache="text"), M.odb(p, world, b), M.odb(p, world, b, join=False),
           M.odb_samples(M.standard(p, world, 2, accumulation=4), p, b),
           M.gmt(p, world, b, shuffle=False), M.bmt(p, world, b, shuffle=False),
           peers.window_pack(p, world, b, 256, peers.sample_seconds_of(p, M8), M8.fits),
           peers.window_pack(p, world, b, len(p), peers.sample_seconds_of(p, M8), M8.fits, name="epoch_pack")]
    for sorted_windows in (False, True):
        verl = peers.verl_dynamic(p, world, b, 8 * world, sorted_windows=sorted_windows)
        assert verl is not None, peers.verl_module()[1]
        out.append(verl)
    if p.text_only:
        out += [M.packing(p, world, b), M.packing(p, world, b, shuffle=False)]
    out.append(M.odb(p, world, b, cost_mode="packed", name="odb_pf"))
    out.append(M.odb(p, world, b, name="odb_global", global_grouping=True, ranks_per_node=2))
    out.append(M.odb(p, world, b, cost_mode="packed", name="odb_pf_global", global_grouping=True))
    peer = M.peer(p, world, b)
    if peer is not None:
        out.append(peer)
    return out


@pytest.mark.parametrize("kind", ["text", "image", "mix"])
def test_every_method_trains_every_sample_exactly_once(small, kind):
    p = small[kind]
    for s in _all_schedules(p):
        check_ledger(s, len(p))               # raises on a lost / duplicated sample
        assert all(len(step) == s.world for step in s.steps)
        if s.expected_samples is None:
            assert sorted(s.indices().tolist()) == list(range(len(p)))


def test_every_schedule_is_priced_with_the_steps_it_runs(small):
    """The priced optimizer steps and micro-steps are the schedule's own, post-balanced ones
    included (a note passed where the step ends belong once priced len(note) steps)."""
    p, world = small["mix"], 4
    m4 = replace(M8, world=world, ranks_per_node=world)
    std = M.standard(p, world, 1, accumulation=4)
    schedules = _all_schedules(p) + [M.odb_samples(std, p, p.token_budget), std]
    for source in (M.odb(p, world, p.token_budget), M.odb_samples(std, p, p.token_budget)):
        for mode in ("padded", "lpt"):
            balanced = M.post_balance(source, p, m4.token_cost, m4.cap_tokens, ranks_per_node=world, mode=mode)
            assert (balanced.optimizer_steps, balanced.micro_steps) == (source.optimizer_steps, source.micro_steps)
            assert balanced.note.endswith(f"post-balanced ({mode}{', memory cap' if mode == 'padded' else ''})")
            schedules.append(balanced)
    assert schedules[-1].optimizer_steps == std.optimizer_steps
    for s in schedules:
        priced = evaluate(features(s, p), p, m4)
        assert (priced.optimizer_steps, priced.micro_steps) == (s.optimizer_steps, s.micro_steps), s.method


@pytest.mark.parametrize("batch,accumulation", [(1, 1), (1, 4), (2, 3)])
def test_odb_samples_keeps_standards_optimizer_steps_and_their_samples(small, batch, accumulation):
    p, world = small["mix"], 4
    std = M.standard(p, world, batch, accumulation=accumulation)
    odb = M.odb_samples(std, p, p.token_budget)
    assert odb.optimizer_steps == std.optimizer_steps
    starts = [0] + [end + 1 for end in odb.step_ends[:-1]]
    for k, (start, end) in enumerate(zip(starts, odb.step_ends)):
        window = std.steps[k * accumulation:(k + 1) * accumulation]
        for r in range(world):  # each rank trains its own Standard share, packed
            want = sorted(i for micro in window for i in micro[r].tolist())
            got = sorted(i for micro in odb.steps[start:end + 1] for i in micro[r].tolist())
            assert got == want, f"step {k}, rank {r}"
        assert end - start + 1 <= batch * accumulation
        for micro in odb.steps[start:end + 1]:   # within the budget (or a lone long sample)
            for b in micro:
                assert len(b) <= 1 or len(b) * int(p.tokens[b].max()) <= p.token_budget
    # padding-free and globally grouped: the same steps, each with the same samples (any rank)
    fast = M.odb_samples(std, p, p.token_budget, "packed", True)
    assert fast.optimizer_steps == std.optimizer_steps
    starts = [0] + [end + 1 for end in fast.step_ends[:-1]]
    for k, (start, end) in enumerate(zip(starts, fast.step_ends)):
        window = std.steps[k * accumulation:(k + 1) * accumulation]
        want = sorted(i for micro in window for b in micro for i in b.tolist())
        assert sorted(i for micro in fast.steps[start:end + 1] for b in micro for i in b.tolist()) == want
        for micro in fast.steps[start:end + 1]:
            assert any(len(b) for b in micro), "a micro-step idle on every rank"
            for b in micro:
                assert len(b) <= 1 or int(p.tokens[b].sum()) <= p.token_budget


def test_ledger_check_catches_loss_and_duplication():
    p = P.ultrachat(50)
    s = M.standard(p, 2, 5)
    s.steps[0][0] = np.concatenate([s.steps[0][0], s.steps[0][1][:1]])  # duplicate one
    with pytest.raises(LedgerError):
        check_ledger(s, len(p))
    s = M.standard(p, 2, 5)
    s.steps.pop()                                                      # lose a step
    with pytest.raises(LedgerError):
        check_ledger(s, len(p))


def test_packing_never_exceeds_the_budget(small):
    p = small["text"]
    for budget in (2048, 4096, 12288):
        s = M.packing(p, 4, budget)
        sums = [int(p.tokens[b].sum()) for step in s.steps for b in step if len(b)]
        assert max(sums) <= budget or all(len(b) == 1 for step in s.steps for b in step
                                          if len(b) and p.tokens[b].sum() > budget)
        check_ledger(s, len(p))


def test_budget_methods_respect_the_padded_budget(small):
    p = small["image"]
    b = p.token_budget
    for s in (M.gmt(p, 4, b), M.odb(p, 4, b)):
        for step in s.steps:
            for batch in step:
                if len(batch) > 1:
                    assert len(batch) * p.tokens[batch].max() <= b


def test_gmt_cut_is_the_greedy_grouping_of_the_whole_epoch(small):
    from odb_factory import SampleCost
    from odb_factory.planning.grouping import Budget, PlannedSample, form_groups

    p = small["mix"]
    samples = [PlannedSample(i, i, SampleCost(int(t), 0, int(v)))
               for i, (t, v) in enumerate(zip(p.tokens.tolist(), p.patches.tolist()))]
    for budget in (3000, 12288):
        ref = [[s.index for s in g] for g in form_groups(samples, Budget(budget)).groups]
        ours = [b.tolist() for b in M.max_tokens_cut(p.tokens, budget, p.patches)]
        assert ours == ref


def test_text_only_cache_can_oom_and_the_tuned_budget_never_does(small):
    p = small["image"]
    m4 = replace(M8, world=4)
    stale = evaluate(features(M.gmt(p, 4, 14336, cache="text"), p), p, m4)
    assert stale.oom_batches > 0 and stale.samples_per_s is None
    budget, s = M.tune_text_cache_budget(p, 4, 14336, m4.fits)
    assert 0 < budget < 14336
    r = evaluate(features(s, p), p, m4)
    assert r.oom_batches == 0 and r.samples_per_s > 0


def test_packing_rejects_multimodal(small):
    with pytest.raises(ValueError):
        M.packing(small["image"], 4, 12288)


def test_post_balancing_keeps_samples_respects_cap_and_never_worsens_the_step(small):
    p = small["mix"]
    m4 = replace(M8, world=4, ranks_per_node=4)
    s = M.odb(p, 4, p.token_budget)
    bal = M.post_balance(s, p, m4.token_cost, m4.cap_tokens, ranks_per_node=4)
    check_ledger(bal, len(p))
    fb, fs = features(bal, p), features(s, p)
    padded = fb.padded()
    assert padded.max() <= m4.cap_tokens
    llm_before = np.where(fs.n > 0, m4.llm_seconds(fs.padded(), fs.attention_sq()), 0).max(axis=1)
    llm_after = np.where(fb.n > 0, m4.llm_seconds(padded, fb.attention_sq()), 0).max(axis=1)
    assert np.all(llm_after <= llm_before + 1e-9)


def test_encoder_stage_balance_is_within_the_list_scheduling_bound(small):
    from bench.simulate import encoder_stage_seconds

    p = small["mix"]
    m4 = replace(M8, world=4, ranks_per_node=4)
    f = features(M.odb(p, 4, p.token_budget), p)
    stage = encoder_stage_seconds(f, p, m4)
    per_image = np.where(p.images > 0, p.patches / np.maximum(p.images, 1), 0.0)
    cost = m4.vision_seconds(1, per_image, per_image ** 2)
    for s in range(f.steps):
        cells = (f.cell // 4) == s
        ids = np.concatenate([f.flat[a:a + int(n)] for a, n in
                              zip(f.starts[cells], f.n.reshape(-1)[f.cell[cells]])])
        jobs = np.repeat(cost[ids], p.images[ids])
        assert stage[s] >= jobs.sum() / 4 - 1e-12
        assert stage[s] <= jobs.sum() / 4 + jobs.max() + 1e-12


# ----------------------------------------------------------------------------- step model
def test_step_model_is_monotone_and_memory_capped():
    for model in (QWEN3_VL_8B, QWEN3_VL_2B):
        for hw in (H20_1NODE, H20_2NODES):
            for mode in ("full", "lora"):
                m = build_step_model(model, hw, mode)
                l = np.arange(1, 20000, 97, dtype=float)
                assert np.all(np.diff(m.sample_seconds(l)) > 0)
                assert np.all(np.diff(m.llm_seconds(l, l * 10)) > 0)
                assert np.all(np.diff(m.memory_bytes(l)) > 0)
                assert m.fits(m.cap_tokens) and not m.fits(m.cap_tokens + 1)
                k = m.safe_batch(16384)
                assert m.fits(k * 16384) and not m.fits((k + 1) * 16384)
    full = build_step_model(QWEN3_VL_8B, H20_1NODE, "full")
    assert build_step_model(QWEN3_VL_8B, H20_1NODE, "lora").a < full.a   # no weight grads
    assert build_step_model(QWEN3_VL_8B, H20_2NODES, "full").comm_opt_s > full.comm_opt_s
    assert full.scaled(2.0).a == pytest.approx(full.a / 2) and full.scaled(2.0).c0 == full.c0


def test_oom_batches_are_reported_not_counted():
    p = P.ultrachat(400)
    s = Schedule("one_big", 2, [[np.arange(0, 200), np.arange(200, 400)]])
    m2 = replace(M8, world=2)
    r = evaluate(features(s, p), p, m2)
    assert r.oom and r.samples_per_s is None and r.tokens_per_s is None


def test_nnls_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = {"c0": 0.03, "tokens": 2e-4, "sum_sq": 3e-9, "images": 0.002, "patches": 1e-5,
            "patch_sq": 2e-10}
    rows = []
    for _ in range(200):
        n, l = rng.integers(1, 16), rng.integers(50, 4000)
        img = int(rng.integers(0, 4))
        pt = img * int(rng.integers(64, 2304))
        row = {"tokens": n * l, "sum_sq": n * l * l, "images": img, "patches": pt,
               "patch_sq": pt * pt / max(1, img)}
        row["time_s"] = true["c0"] + sum(true[k] * row[k] for k in true if k != "c0")
        rows.append(row)
    fit = fit_step_model(rows)
    for k, v in true.items():
        assert fit.coef[k] == pytest.approx(v, rel=1e-4, abs=1e-12)
    assert fit.mape < 1e-6 and fit.r2 > 0.999999
    noisy = [{**r, "time_s": r["time_s"] * (1 + 0.02 * rng.standard_normal())} for r in rows]
    fit = fit_step_model(noisy)
    assert fit.coef["tokens"] == pytest.approx(true["tokens"], rel=0.1)
    assert 0.005 < fit.mape < 0.05
    with pytest.raises(ValueError):
        fit_step_model(rows[:1])


def test_measured_hook_writes_fit_and_plot(tmp_path):
    rows = [{"tokens": t, "sum_sq": t * t, "time_s": 0.01 + 1e-4 * t} for t in range(100, 2000, 100)]
    md = measured_report.add_measured_rows(rows, tmp_path)
    assert "Measured layer" in md and (tmp_path / "measured_fit.csv").exists()
    assert (tmp_path / "measured_vs_predicted.png").stat().st_size > 0


# ----------------------------------------------------------------------------- data wait
def test_data_wait_is_non_increasing_in_depth_and_zero_for_an_instant_producer(small):
    p = small["image"]
    s = M.odb(p, 8, p.token_budget, buffer_size=64)
    t = step_times(features(s, p), M8)
    round_of, need = rounds_of(s, 64)
    consume = len(p) / 8 / float(t.sum())             # samples per rank per second
    prep = 4 / (1.5 * consume)                         # 4 workers, 1.5x the trainer's rate
    waits = [data_wait(t, round_of, need, d, prep_s=prep).wait_s for d in (1, 2, 4, 8, 32, 128)]
    assert all(a >= b - 1e-9 for a, b in zip(waits, waits[1:])) and waits[0] > waits[-1]
    assert data_wait(t, round_of, need, 1, prep_s=0.0, align_s=0.0).wait_s == 0.0


# ----------------------------------------------------------------------------- end to end
def test_tiny_end_to_end_row():
    from bench import lab as L

    p = P.ultrachat(1200, seed=2)
    lab = L.Lab(seed=0)
    row = L.evaluate_row(lab, p, "8B", "1n-full", mfu=0.7)
    res = row["results"]
    assert {"standard", "odb", "odb_balanced", "gmt", "packing", "sorted"} <= set(res)
    for r in res.values():
        assert r.samples == len(p) and not r.oom
        assert 0 <= r.padding_ratio < 1 and r.max_over_lb >= 1 - 1e-9
    assert res["odb"].samples_per_s > res["standard"].samples_per_s
    assert res["odb"].optimizer_steps < res["standard"].optimizer_steps
    e = row["explain"]
    assert e["ratio"] == pytest.approx(e["ours"] / 1.77)
    assert e["ours"] == pytest.approx(res["odb"].samples_per_s / res["standard"].samples_per_s)
    md = tables.main_table([row])
    assert "UltraChat-200K" in md and "ODB" in md
    # the limit: odb_pf_global's own work with max = mean, so no schedule of that work is faster
    assert {"odb_pf", "odb_global", "odb_pf_global", "limit"} <= set(res)
    limit, pf = res["limit"], res["odb_pf_global"]
    assert limit.samples_per_s >= pf.samples_per_s and limit.time_s == pytest.approx(pf.mean_rank_s + pf.fixed_s)
    assert res["odb_pf"].padding_ratio == 0 and res["odb_global"].padding_ratio < res["odb"].padding_ratio
    line = tables.standing_rows([row])[0]
    fastest = max((r.samples_per_s, k) for k, r in res.items() if k in tables.ODB_VARIANTS)
    other = max((r.samples_per_s, k) for k, r in res.items() if k not in tables.ODB_VARIANTS + ("limit",))
    assert line["best ODB / best other"] == pytest.approx(fastest[0] / other[0])
    assert line["best ODB"] == tables.LABEL[fastest[1]] and line["best other"] == tables.LABEL[other[1]]
    assert line["padding-free / limit"] == pytest.approx(pf.samples_per_s / limit.samples_per_s)
    assert f"{line['best ODB / best other']:.3f}×" in tables.standing_summary([row])
    variants = {v["ODB variant"]: v for v in tables.variant_rows([row])}
    assert variants["ODB"]["lowest"] == pytest.approx(res["odb"].samples_per_s / other[0])
    assert variants[tables.LABEL[fastest[1]]]["highest"] == pytest.approx(line["best ODB / best other"])


# ----------------------------------------------------------------------------- report verdicts
def _row_with(**sps):
    from types import SimpleNamespace

    results = {k: SimpleNamespace(samples_per_s=v, max_over_mean=1.5) for k, v in sps.items()}
    return {"results": results, "safe_bs": 1}


def test_verdicts_name_the_faster_method():
    from bench.paper_comparison import versus_odb

    assert versus_odb(10.0, 11.0, "GMT") == "GMT 10% faster than ODB"
    assert versus_odb(11.0, 10.0, "GMT") == "ODB 10% faster than GMT"
    assert versus_odb(10.0, 10.01, "GMT") == "GMT as fast as ODB"
    assert versus_odb(20.1, 10.0, "GMT") == "ODB 2.01× as fast as GMT"


def test_sorted_verdict_follows_the_numbers():
    from bench.paper_comparison import _sorted_note

    paper_like_shuffled = _sorted_note(_row_with(standard=1.0, sorted=2.6, sorted_shuffled=1.0), 1.03)
    assert "within ±15% of the shuffled variant, not of the in-order one" in paper_like_shuffled
    neither = _sorted_note(_row_with(standard=1.0, sorted=2.6, sorted_shuffled=2.0), 1.03)
    assert "Neither variant is within ±15%" in neither and "evidently" not in neither
    both = _sorted_note(_row_with(standard=1.0, sorted=1.1, sorted_shuffled=1.0), 1.03)
    assert "Both variants are within ±15%" in both


def test_ablation_sentences_are_computed_from_their_rows():
    from bench.report import lmax_text, window_text

    lmax = [{"workload": "text", "L_max": b, "oom_batches": int(b > 30000), "cap_tokens": 25000}
            for b in (8192, 32768)]
    lmax += [{"workload": "image", "L_max": b, "oom_batches": int(b > 20000), "cap_tokens": 25000}
             for b in (8192, 24576)]
    text = lmax_text(lmax)
    assert "text from 32768; image from 24576" in text and "image OOM at or below the cap" in text
    rows = [{"case": "c", "B": b, "padding_ratio": pad, "samples_per_s": sps}
            for b, pad, sps in ((64, 0.01, 9.0), (256, 0.02, 10.0), (4096, 0.03, 9.5))]
    text = window_text(rows)
    assert "pads more than the largest in 0 of 1 cases" in text and "-5% samples/s" in text


def test_audio_stage_bench_rows_and_sentences_follow_their_numbers(tmp_path):
    import csv

    from bench import audio_stage
    for workload in ("asr", "spoken_qa", "omni_mix"):
        row = audio_stage.measure(workload, 8, 4, steps=5, seed=3)
        assert 1.0 <= row["max_over_lb_lpt"] <= row["max_over_lb_before"]
        assert 1.0 <= row["max_over_lb_min_move"] <= row["max_over_lb_before"]
    stages = audio_stage.omni_stages(8, 4, steps=5, seed=3)
    for stage in ("llm", "vision", "audio"):
        assert 1.0 <= stages[f"{stage}_max_over_lb_after"] <= stages[f"{stage}_max_over_lb_before"]
    text = audio_stage.omni_section(True, tmp_path)
    rows = list(csv.DictReader((tmp_path / "omni_stages.csv").open()))
    gains = [float(r["step_time_ratio"]) / float(r["step_time_ratio_llm_only"]) - 1 for r in rows]
    assert f"{min(gains):+.1%} to {max(gains):+.1%}" in text
    assert ("it loses at" in text) == any(g < 0 for g in gains)
    assert len(list(csv.DictReader((tmp_path / "audio_stage.csv").open()))) == 12


def test_loader_overhead_control_plans_the_same_steps():
    """bench.loader_overhead's "costs known" loader differs from ODB only in not computing
    the costs: the looked-up costs are DefaultCost's and both plan the same steps."""
    from bench.loader_overhead import KnownCost, ServedSamples, identity
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.cost import DefaultCost
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    samples = [LengthDataset(long_tail_lengths(300, cv=1.0, mean=300, seed=3, minimum=16, maximum=1024))[i]
               for i in range(300)]
    known = KnownCost(samples)
    assert [known(s) for s in samples] == [DefaultCost()(s) for s in samples]
    config = ODBConfig(token_budget=4096, buffer_size=64)
    steps = [[b.indices for b in ODBDataLoader(ServedSamples(samples), config, collate_fn=identity, cost_fn=cost)]
             for cost in (known, None)]
    assert steps[0] == steps[1] and sorted(i for s in steps[0] for i in s) == list(range(300))
