"""The audio-reading patch (patches/odb_factory_patches/llamafactory_audio_reading.py): LLaMA-Factory's
`_regularize_audios` decodes real wav/flac/mp3 files (soundfile) and an m4a (the PyAV fallback),
mixes stereo down, resamples 44.1 kHz to the processor's 16 kHz, and names a file it cannot read."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

pytest.importorskip("llamafactory")
sf = pytest.importorskip("soundfile")

from odb_factory_patches import llamafactory_audio_reading as patch

RATE = 16000
PCM16 = 1 / 32768  # one step of the 16-bit files


def _signal(rate, seconds, channels, seed):
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(rate * seconds))) / rate
    mono = 0.5 * np.sin(2 * math.pi * 440 * t) + 0.2 * np.sin(2 * math.pi * 1250 * t) + rng.normal(0, 0.01, t.size)
    if channels == 1:
        return mono[:, None].astype(np.float32)
    return np.stack([mono, -0.3 * mono + 0.1], axis=1).astype(np.float32)


def _write_m4a(path, data, rate):
    """AAC in an MP4 container, which libsndfile does not read (the PyAV fallback does)."""
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "mono" if data.shape[1] == 1 else "stereo"
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data.T), format="fltp", layout=stream.layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """name -> (path, written data (frames, channels), rate)."""
    root = tmp_path_factory.mktemp("audio")
    specs = {"wav16_mono": ("wav", "PCM_16", RATE, 1, 1.7), "flac16_stereo": ("flac", "PCM_16", RATE, 2, 0.9),
             "wav44_stereo": ("wav", "PCM_16", 44100, 2, 2.3), "flac44_mono": ("flac", "PCM_16", 44100, 1, 0.31),
             "mp3_44_stereo": ("mp3", "MPEG_LAYER_III", 44100, 2, 3.1),
             "mp3_16_mono": ("mp3", "MPEG_LAYER_III", RATE, 1, 1.2)}
    out = {}
    for seed, (name, (ext, subtype, rate, channels, seconds)) in enumerate(specs.items()):
        path = root / f"{name}.{ext}"
        data = _signal(rate, seconds, channels, seed)
        sf.write(str(path), data, rate, subtype=subtype)
        out[name] = (path, data, rate)
    path, data = root / "aac44_stereo.m4a", _signal(44100, 1.5, 2, 9)
    _write_m4a(path, data, 44100)
    out["aac44_stereo"] = (path, data, 44100)
    return out


@pytest.fixture(scope="module")
def plugin():
    from llamafactory.data.mm_plugin import get_mm_plugin
    patch.apply()
    return get_mm_plugin("qwen2_omni", image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>")


def _expected(data, rate):
    """Upstream's processing of what was written: channel mean, torchaudio resample to 16 kHz."""
    import torch
    import torchaudio

    wave = torch.from_numpy(data.T.copy()).mean(dim=0, keepdim=True)
    if rate != RATE:
        wave = torchaudio.functional.resample(wave, rate, RATE)
    return wave.squeeze(0).numpy()


def test_the_patch_replaces_upstream_and_keeps_its_signature(plugin, clips):
    import inspect

    from llamafactory.data.mm_plugin import MMPluginMixin
    method = MMPluginMixin._regularize_audios
    assert method._odb_wrapped and "torchaudio" in method.__wrapped__.__code__.co_names
    assert inspect.signature(method) == inspect.signature(method.__wrapped__)
    patch.apply()  # idempotent
    assert MMPluginMixin._regularize_audios is method
    # what the patch is for: torchaudio.load cannot decode here (torchcodec / FFmpeg missing)
    with pytest.raises(Exception):
        method.__wrapped__(plugin, [str(clips["wav16_mono"][0])], sampling_rate=RATE)


@pytest.mark.parametrize("name", ["wav16_mono", "flac16_stereo", "wav44_stereo", "flac44_mono"])
def test_lossless_files_decode_to_upstreams_result(plugin, clips, name):
    path, data, rate = clips[name]
    out = plugin._regularize_audios([str(path)], sampling_rate=RATE)
    assert out["sampling_rates"] == [RATE]
    (audio,) = out["audios"]
    assert isinstance(audio, np.ndarray) and audio.dtype == np.float32 and audio.ndim == 1
    expected = _expected(data, rate)
    assert audio.shape == expected.shape
    assert audio.shape[0] == math.ceil(data.shape[0] * RATE / rate)  # the written duration, at 16 kHz
    assert np.abs(audio - expected).max() < 2 * PCM16  # 16-bit quantisation, through the resampler


@pytest.mark.parametrize("name", ["mp3_44_stereo", "mp3_16_mono", "aac44_stereo"])
def test_lossy_files_keep_their_duration_and_signal(plugin, clips, name):
    path, data, rate = clips[name]
    (audio,) = plugin._regularize_audios([path], sampling_rate=RATE)["audios"]  # a pathlib.Path
    expected = _expected(data, rate)
    if name.startswith("mp3"):  # libsndfile writes gapless mp3: the exact sample count comes back
        assert audio.shape == expected.shape
    else:  # AAC adds its encoder delay and pads to whole frames: at most 2 frames of 1024 samples more
        assert 0 <= audio.shape[0] - expected.shape[0] <= math.ceil(2 * 1024 * RATE / rate)
    n = min(audio.shape[0], expected.shape[0])
    # the same waveform: aligned (gapless) and highly correlated
    lag = max(range(-400, 401), key=lambda k: float(np.dot(np.roll(audio[:n], -k), expected[:n])))
    corr = np.corrcoef(np.roll(audio[:n], -lag)[1000:-1000], expected[:n][1000:-1000])[0, 1]
    assert corr > 0.95, (name, lag, corr)
    if name.startswith("mp3"):
        assert lag == 0
    else:
        with pytest.raises(sf.LibsndfileError):  # so this one came through the PyAV fallback
            sf.read(str(path))


def test_file_objects_bytes_and_arrays(plugin, clips):
    path, data, rate = clips["flac44_mono"]
    array = np.zeros(800, dtype=np.float32)
    with open(path, "rb") as f:
        m4a = io.BytesIO(clips["aac44_stereo"][0].read_bytes())
        out = plugin._regularize_audios([f, path.read_bytes(), array, m4a], sampling_rate=RATE)["audios"]
    assert out[2] is array, "numpy inputs pass through, as upstream"
    np.testing.assert_array_equal(out[0], out[1])
    assert out[0].shape == _expected(data, rate).shape
    assert out[3].shape[0] > RATE  # the m4a through PyAV from memory (1.5 s)


def test_an_unreadable_file_is_named_with_both_errors(plugin, clips, tmp_path):
    bad = tmp_path / "not_audio.wav"
    bad.write_bytes(b"RIFF....WAVEfmt this is not a wave file at all" * 20)
    good = str(clips["wav16_mono"][0])
    with pytest.raises(patch.AudioReadError) as err:
        plugin._regularize_audios([good, str(bad)], sampling_rate=RATE)
    text = str(err.value)
    assert repr(str(bad)) in text and "soundfile:" in text and "PyAV:" in text, text
    with pytest.raises(patch.AudioReadError, match="missing.flac"):
        plugin._regularize_audios([str(tmp_path / "missing.flac")], sampling_rate=RATE)
