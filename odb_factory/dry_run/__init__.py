"""Dry run of a LLaMA-Factory training recipe: what ODB would do with it, before any training.

    python -m odb_factory.dry_run RECIPE.yaml [--world-size N] [--rows N] [--json PATH] [key=value ...]

The recipe is parsed by LLaMA-Factory's own parser with the `odb_*` keys (`recipe`), and what
its stage (sft, pt or dpo) changes is decided as training decides it (`stages`); the training
rows go through the run's own per-sample pipeline in worker processes (`pipeline`); the
engine's planner plans one epoch in both `odb_step` modes (stage dpo: `samples` only) beside
LLaMA-Factory's fixed batches and the figures are computed (`report`); the step-time model
predicts the speedup with a band (`speedup`) and picks a token budget (`budget`); `render`
prints them. No model weights are loaded: only the tokenizer, the processor and the model's
config.
"""
