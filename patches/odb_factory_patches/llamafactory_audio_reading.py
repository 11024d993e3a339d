"""Target: llamafactory.data.mm_plugin.MMPluginMixin._regularize_audios (written for LLaMA-Factory 0.9.5).

Upstream reads every audio path or file object with ``torchaudio.load``. torchaudio 2.11, the
build that loads with torch 2.14.1, hands decoding to torchcodec, which needs a system FFmpeg:
without them every row with an ``audios`` column fails when its sample is processed (Qwen2.5-Omni,
Qwen3-Omni, Qwen2-Audio, MiniCPM-o, ... templates). This replacement reads with soundfile
(libsndfile, bundled in its wheel: wav, flac, mp3, ogg, aiff, ...) and falls back to PyAV (FFmpeg,
bundled in its wheel: m4a/aac, opus, audio in mp4/webm, ...). The rest is upstream's: channels
are averaged to mono, the clip is resampled to ``sampling_rate`` with
``torchaudio.functional.resample`` (pure torch, as upstream), float32 numpy arrays are returned,
numpy inputs pass through unchanged, and the result has the same keys (``audios``,
``sampling_rates``). A file neither can read raises ``AudioReadError`` naming the file and both
readers' errors. Applied for every run the patches apply to, with or without ``odb_*`` keys: it
only changes how a file is decoded.
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any


class AudioReadError(RuntimeError):
    """An audio input that neither soundfile nor PyAV could decode."""


def _describe(audio: Any) -> str:
    if isinstance(audio, (str, os.PathLike)):
        return repr(os.fspath(audio))
    name = getattr(audio, "name", None)
    return f"{type(audio).__name__} {name!r}" if isinstance(name, str) else f"a {type(audio).__name__} object"


def _read_soundfile(source: Any):
    """(channels, frames) float32 array and sampling rate."""
    import soundfile

    data, rate = soundfile.read(source, dtype="float32", always_2d=True)
    return data.T, int(rate)


def _read_pyav(source: Any):
    """(channels, frames) float32 array and sampling rate, decoded by FFmpeg through PyAV."""
    import av
    import numpy as np

    with av.open(source, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream")
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        to_planar = av.AudioResampler(format="fltp")  # float planar, source layout and rate
        chunks = []
        for frame in container.decode(stream):
            chunks += [out.to_ndarray() for out in to_planar.resample(frame)]
        chunks += [out.to_ndarray() for out in to_planar.resample(None)]
    if not chunks or not rate:
        raise ValueError("no audio samples decoded")
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), int(rate)


def read_audio(audio: Any):
    """Decode a path, file object or encoded bytes: ((channels, frames) float32 array, rate).
    soundfile first, PyAV second; AudioReadError names the input and both errors."""
    source = io.BytesIO(audio) if isinstance(audio, (bytes, bytearray)) else audio
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    start = source.tell() if hasattr(source, "seek") else None
    errors = []
    for name, reader in (("soundfile", _read_soundfile), ("PyAV", _read_pyav)):
        if start is not None:
            source.seek(start)
        try:
            return reader(source)
        except Exception as exc:  # each reader has its own error types (and may be missing)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise AudioReadError(f"cannot read audio {_describe(audio)} ({'; '.join(errors)})")


def regularize_audios(self, audios, sampling_rate: float, **kwargs):
    """Upstream's `_regularize_audios`, decoding with soundfile / PyAV instead of torchaudio.load."""
    import numpy as np
    import torch
    import torchaudio

    results, sampling_rates = [], []
    for audio in audios:
        if not isinstance(audio, np.ndarray):
            data, rate = read_audio(audio)
            wave = torch.from_numpy(np.ascontiguousarray(data))
            if wave.shape[0] > 1:
                wave = wave.mean(dim=0, keepdim=True)
            if rate != sampling_rate:
                wave = torchaudio.functional.resample(wave, rate, int(sampling_rate))
            audio = wave.squeeze(0).numpy()
        results.append(audio)
        sampling_rates.append(sampling_rate)
    return {"audios": results, "sampling_rates": sampling_rates}


def apply() -> None:
    from llamafactory.data import mm_plugin

    original = mm_plugin.MMPluginMixin._regularize_audios
    if getattr(original, "_odb_wrapped", False):
        return

    @functools.wraps(original)  # upstream's name and signature; upstream's function as __wrapped__
    def _regularize_audios(self, audios, sampling_rate, **kwargs):
        return regularize_audios(self, audios, sampling_rate, **kwargs)

    _regularize_audios._odb_wrapped = True
    mm_plugin.MMPluginMixin._regularize_audios = _regularize_audios
