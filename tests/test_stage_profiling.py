"""``python -m odb_factory.stage_profiling`` on the tiny Qwen3-VL: output structure and fit."""

import json

import numpy as np
import pytest

from odb_factory.balance import StageCostModel
from odb_factory.stage_profiling import image_grid, main, stage_model


def test_image_grid():
    assert image_grid(64, 2) == (1, 8, 8)
    assert image_grid(100, 2) == (1, 10, 10)
    t, h, w = image_grid(30, 2)  # rounded up to a multiple of merge**2 = 4
    assert t == 1 and h % 2 == 0 and w % 2 == 0 and h * w == 32
    assert image_grid(1, 2) == (1, 2, 2)


def test_profile_main_tiny(tiny_model, tmp_path, capsys):
    out_json = tmp_path / "prof.json"
    res = main(["--model", str(tiny_model), "--lengths", "16,48,96,160", "--repeats", "1",
                "--warmup", "1", "--stage", "both", "--device", "cpu", "--json", str(out_json),
                "--quiet"])
    printed = capsys.readouterr().out
    assert "llm" in printed and "vision" in printed and "R2=" in printed
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(res))
    assert set(res["stages"]) == {"llm", "vision"}
    assert res["stages"]["llm"]["lengths"] == [16, 48, 96, 160]
    assert res["stages"]["vision"]["lengths"] == [16, 48, 96, 160]  # all multiples of 4
    for stage, r in res["stages"].items():
        assert r["stage"] == stage
        assert len(r["median_s"]) == len(r["lengths"]) == len(r["times_s"]) == 4
        assert all(t > 0 for t in r["median_s"])
        for k in ("c0", "a", "b"):
            assert r[k] >= 0
        assert r["r2"] <= 1.0 and r["mean_rel_error"] >= 0
        model = stage_model(r)
        assert isinstance(model, StageCostModel)
        grid = np.linspace(0, 4096, 257)
        assert np.all(np.diff(model(grid)) >= 0)  # non-decreasing
        assert model(160) > 0


def test_profile_single_stage_and_errors(tiny_model):
    res = main(["--model", str(tiny_model), "--lengths", "8,32", "--repeats", "1", "--warmup", "0",
                "--stage", "vision", "--patches", "6,40", "--device", "cpu", "--quiet"])
    assert set(res["stages"]) == {"vision"}
    assert res["stages"]["vision"]["lengths"] == [8, 40]  # 6 rounded up to 8
    with pytest.raises(SystemExit):
        main(["--lengths", "0,5"])
