"""`make demo`'s three runs parse the way `llamafactory-cli train RECIPE KEY=VALUE...` reads
them (OmegaConf's command-line reading turns a bare `no` into False, which once broke the
demo's first run): every run's arguments reach LLaMA-Factory's parser and are accepted."""

from __future__ import annotations

import sys


def test_demo_runs_parse_as_the_cli_reads_them(tmp_path, monkeypatch, tiny_model, demo_data):
    import llamafactory.train.tuner  # noqa: F401  (the import hook patches LLaMA-Factory here)
    import odb_factory_patches
    odb_factory_patches.apply()
    from llamafactory.hparams import get_train_args, read_args
    from odb_factory.demo.__main__ import OVERRIDES, REPO, RUNS
    for label, recipe in RUNS:
        monkeypatch.setattr(sys, "argv", ["llamafactory-cli", str(REPO / recipe), *OVERRIDES])
        args = read_args()
        args.update(model_name_or_path=str(tiny_model), dataset_dir=str(demo_data),
                    output_dir=str(tmp_path / label.replace(" ", "_")))
        _, data_args, training_args, _, _ = get_train_args(args)
        assert training_args.gradient_accumulation_steps in (1, 4), label  # samples mode hands accumulation to ODB
        assert data_args.val_size == 0.1 and training_args.do_eval, label
