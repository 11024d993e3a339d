"""LLaMA-Factory integration: `odb_*` YAML keys, lazy per-sample preprocessing and the
trainer wiring. Applied to a stock `llamafactory-cli` by the import hook in
`odb_factory_hook` (installed as a .pth file); the patches themselves live in `patches/odb_factory_patches/`."""
