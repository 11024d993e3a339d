"""Pure planning: functions of sample costs -> groups, alignment targets and per-round
plans. No processes, queues or collectives here, so every claim can be tested for any
world size in one process (see tests/planning/ and docs/dgap.md)."""
