"""Turn the recipes' data sets, as published, into LLaMA-Factory 0.9.5 training files.

    python -m odb_factory.data prepare {ultrachat,llava150k,llava665k,sharegpt4o,alpaca,mmmix} \
        --raw DIR --out DIR [--tokenizer DIR] [--drop-missing]

writes `<name>.parquet` (sharegpt formatting), `dataset_info.json` and `prepare_stats.json`
into --out, checks every image the rows name, and prints the `dataset_dir=` / `media_dir=` keys
for `llamafactory-cli train` and the length statistics of bench/README.md's workload profiles.
Modules: `layouts` (where the published files lie), `formats` (record -> row, pure),
`registry` (dataset_info entries, MM-Mix keys), `stats` (token counts, CV, f_s), `prepare`
(the pipeline).
"""

from .prepare import Options, PrepareError, prepare

__all__ = ["Options", "PrepareError", "prepare"]
