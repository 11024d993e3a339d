"""Target: llamafactory.data.loader._get_preprocessed_dataset (written for LLaMA-Factory 0.9.5).

With ODB and odb_lazy_preprocess (the default), the training split of stage sft, pt or dpo
(data stage rm: chosen/rejected pairs) is not mapped up front: it becomes a LazySupervisedDataset that runs the same dataset processor per
sample in the DataLoader workers, after a pre-flight check of its media files
(odb_factory/llamafactory/preflight.py) and of rows whose vision tokens cutoff_len would cut
(odb_factory/llamafactory/cutoff_preflight.py). Evaluation splits and every other case run upstream.
"""

from __future__ import annotations

import functools


def apply() -> None:
    from llamafactory.data import loader

    original = loader._get_preprocessed_dataset
    if getattr(original, "_odb_wrapped", False):
        return

    @functools.wraps(original)
    def _get_preprocessed_dataset(dataset, data_args, training_args, stage, template, tokenizer,
                                  processor=None, is_eval=False):
        from odb_factory.llamafactory import cutoff_preflight, preflight
        from odb_factory.llamafactory.lazy_dataset import LazySupervisedDataset
        from odb_factory.llamafactory.run import run_of
        run = run_of(data_args)
        from odb_factory.llamafactory.arguments import DATA_STAGES
        if (run is None or not run.options.adapter.lazy_preprocess or is_eval or stage not in DATA_STAGES.values()
                or dataset is None or data_args.streaming):
            return original(dataset, data_args, training_args, stage, template, tokenizer,
                            processor, is_eval)
        dataset_processor = loader._get_dataset_processor(data_args, stage, template, tokenizer, processor)
        lazy = LazySupervisedDataset(dataset, dataset_processor, stage)
        if len(lazy) == 0:
            raise RuntimeError("Cannot find valid samples, check `data/README.md` for the data format.")
        # once per node: LLaMA-Factory runs this under main_process_first, so the other local
        # ranks wait, and torchrun stops them when this one raises
        if getattr(training_args, "local_process_index", 0) == 0:
            preflight.check_media(dataset, lazy.rows, getattr(data_args, "media_dir", None))
            cutoff_preflight.check_cutoff(lazy)
        if training_args.should_log:
            print("training example (processed lazily, per sample, in the DataLoader workers):")
            dataset_processor.print_data_example(lazy[0])
        return lazy

    _get_preprocessed_dataset._odb_wrapped = True
    loader._get_preprocessed_dataset = _get_preprocessed_dataset
