"""Paper-scale simulation without GPUs: epoch schedules from the engine's own planner, priced
by a step-time and memory model. Shared by the benchmark (`bench/`) and the dry-run plan
(`python -m odb_factory.dry_run`)."""
