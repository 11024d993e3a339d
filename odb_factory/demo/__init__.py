"""Offline demo assets: a tiny random Qwen3-VL and a generated mixed text/image data set."""
