"""Generated audio SFT data (LLaMA-Factory sharegpt, ``audios`` column) for the tiny Qwen2.5-Omni.

Everything is made up from a seed: clips are tones and chirps with syllable-like bursts and a little
noise, 0.3 s to 12 s long; transcripts and answers use the made-up lexicon of ``synthetic_data``.
Nothing is downloaded or copied (images, when asked for, are referenced by absolute path).

The clips come in every combination of format (wav, flac, mp3, all written with soundfile), sampling
rate (16 kHz, the feature extractor's, and 44.1 kHz, which the reader must resample) and channels
(mono, and stereo, which the reader must mix down), so a run goes through each reading path.

Rows (``ROW_KINDS``): ASR-like (a long clip, a transcript as long as the clip), spoken QA (a long clip,
a one-word answer), two clips compared (with an image when ``image_dir`` is given), and text-only
rows. Each user turn holds as many ``<audio>`` (and ``<image>``) placeholders as the row has media.

Layout written to ``out_dir``::

    dataset_info.json   registers the set (``omni_demo``, sharegpt, messages/audios[/images] columns)
    omni_demo.json      the rows
    audios/clip_*.wav|flac|mp3   the clips (paths in omni_demo.json are relative to ``out_dir``,
                        LLaMA-Factory's default media_dir)
    audio_clips.json    per clip: file, format, sampling rate, channels, frames written, seconds

CLI: ``python -m odb_factory.demo.audio_data OUT_DIR [--image-dir D] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

from odb_factory.demo.synthetic_data import register_dataset

DATASET_NAME = "omni_demo"
DATA_FILE = "omni_demo.json"
AUDIO_DIR = "audios"
CLIPS_FILE = "audio_clips.json"

FORMATS = (("wav", "WAV", "PCM_16"), ("flac", "FLAC", "PCM_16"), ("mp3", "MP3", "MPEG_LAYER_III"))
SAMPLING_RATES = (16000, 44100)
CHANNELS = (1, 2)
MIN_SECONDS, MAX_SECONDS = 0.3, 12.0
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")

# (kind, rows): about 36 rows in all
ROW_KINDS = (("asr", 12), ("spoken_qa", 10), ("compare", 8), ("text", 6))


def _synth(rng: random.Random, seconds: float, rate: int, channels: int):
    """A tone or chirp with syllable-like bursts plus noise, float32 in [-1, 1], (frames, channels)."""
    import numpy as np

    n = max(1, int(round(seconds * rate)))
    t = np.arange(n, dtype=np.float64) / rate
    f0 = rng.uniform(110.0, 880.0)
    if rng.random() < 0.5:  # chirp: a linear sweep to f1
        f1 = rng.uniform(110.0, 3000.0)
        phase = 2 * math.pi * (f0 * t + (f1 - f0) * t * t / (2 * max(seconds, 1e-3)))
    else:  # tone with vibrato
        phase = 2 * math.pi * f0 * t + rng.uniform(0.5, 4.0) * np.sin(2 * math.pi * rng.uniform(3, 7) * t)
    wave = sum(rng.uniform(0.2, 1.0) / k * np.sin(k * phase) for k in range(1, rng.randint(1, 4) + 1))
    # bursts of 80-400 ms separated by short gaps, with 10 ms ramps
    envelope = np.zeros(n)
    pos = 0
    while pos < n:
        length = int(rng.uniform(0.08, 0.4) * rate)
        burst = np.ones(min(length, n - pos)) * rng.uniform(0.3, 1.0)
        ramp = min(len(burst) // 2, int(0.01 * rate))
        if ramp:
            burst[:ramp] *= np.linspace(0, 1, ramp)
            burst[-ramp:] *= np.linspace(1, 0, ramp)
        envelope[pos:pos + len(burst)] = burst
        pos += len(burst) + int(rng.uniform(0.02, 0.15) * rate)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0.0, 0.02, n)
    mono = wave * envelope
    mono = 0.8 * mono / max(1e-9, float(np.abs(mono).max())) + noise
    if channels == 1:
        out = mono[:, None]
    else:  # the second channel quieter and slightly delayed
        delay = int(0.002 * rate)
        out = np.stack([mono, 0.6 * np.concatenate([np.zeros(delay), mono[:n - delay]])], axis=1)
    return np.clip(out, -1.0, 1.0).astype(np.float32)


def _write_clip(out: Path, index: int, seconds: float, rng: random.Random) -> dict[str, Any]:
    import soundfile as sf

    ext, fmt, subtype = FORMATS[index % len(FORMATS)]
    rate = SAMPLING_RATES[(index // len(FORMATS)) % len(SAMPLING_RATES)]
    channels = CHANNELS[(index // (len(FORMATS) * len(SAMPLING_RATES))) % len(CHANNELS)]
    name = f"{AUDIO_DIR}/clip_{index:03d}.{ext}"
    data = _synth(rng, seconds, rate, channels)
    sf.write(str(out / name), data, rate, format=fmt, subtype=subtype)
    return {"file": name, "format": ext, "sampling_rate": rate, "channels": channels,
            "frames": int(data.shape[0]), "seconds": round(data.shape[0] / rate, 6)}


def _images(image_dir: str | Path | None) -> list[str]:
    if image_dir is None:
        return []
    folder = Path(image_dir).absolute()
    found = sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not found:
        raise FileNotFoundError(f"no image ({', '.join(IMAGE_SUFFIXES)}) in {folder}")
    return found


def write_audio_demo(out_dir: str | Path, image_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Write the ``omni_demo`` data set to ``out_dir`` and return ``out_dir``.

    Deterministic for ``(seed, image_dir)``: the same rows and the same clip files. With ``image_dir``,
    the ``compare`` rows also show an image from it (absolute paths; jpg/png files, in name order).
    """
    from odb_factory.demo.synthetic_data import WordSampler, make_lexicon

    out = Path(out_dir)
    (out / AUDIO_DIR).mkdir(parents=True, exist_ok=True)
    for stale in (out / AUDIO_DIR).glob("clip_*"):  # only files this generator names
        stale.unlink()
    images = _images(image_dir)
    sampler = WordSampler(make_lexicon(seed))
    rng = random.Random(f"odb-audio-demo-{seed}")
    clips: list[dict[str, Any]] = []

    def clip(low: float, high: float) -> str:
        seconds = round(rng.uniform(low, high), 3)
        clips.append(_write_clip(out, len(clips), seconds, rng))
        return clips[-1]["file"]

    rows: list[dict[str, Any]] = []
    for kind, count in ROW_KINDS:
        for _ in range(count):
            audios: list[str] = []
            row_images: list[str] = []
            if kind == "asr":
                audios.append(clip(4.0, MAX_SECONDS))
                words = max(4, int(clips[-1]["seconds"] * rng.uniform(2.0, 3.0)))
                prompt = "<audio>" + rng.choice(("Transcribe the recording.", "Write down what is said.",
                                                  "What does the speaker say? Give every word."))
                answer = sampler.text(rng, words)
            elif kind == "spoken_qa":
                audios.append(clip(1.5, 10.0))
                prompt = "<audio>" + rng.choice(("Answer the spoken question in one word.",
                                                  "Listen and reply with a single word."))
                answer = sampler.words(rng, 1)[0]
            elif kind == "compare":
                audios += [clip(MIN_SECONDS, 1.0), clip(0.5, 3.0)]
                question = sampler.text(rng, rng.randint(6, 20))
                if images:
                    row_images.append(images[len(rows) % len(images)])
                    prompt = f"<image>Here are two sounds: <audio> and <audio>. {question}"
                else:
                    prompt = f"Here are two sounds: <audio> and <audio>. {question}"
                answer = sampler.text(rng, rng.randint(3, 40))
            else:
                prompt = sampler.text(rng, rng.randint(5, 40))
                answer = sampler.text(rng, rng.randint(2, 60))
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            row: dict[str, Any] = {"messages": messages, "audios": audios}
            if images:
                row["images"] = row_images
            rows.append(row)
    order = list(range(len(rows)))
    rng.shuffle(order)  # kinds interleaved, so any prefix (max_samples) has every kind
    rows = [rows[i] for i in order]

    with open(out / DATA_FILE, "w", encoding="utf-8") as f:
        json.dump(rows, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(out / CLIPS_FILE, "w", encoding="utf-8") as f:
        json.dump(clips, f, indent=1)
        f.write("\n")
    columns = {"messages": "messages", "audios": "audios"}
    if images:
        columns["images"] = "images"
    register_dataset(out, DATASET_NAME, DATA_FILE, columns)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the generated omni_demo audio data set (LLaMA-Factory sharegpt).")
    p.add_argument("out_dir")
    p.add_argument("--image-dir", default=None, help="a folder of jpg/png images for the compare rows")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = write_audio_demo(a.out_dir, image_dir=a.image_dir, seed=a.seed)
    clips = json.loads((out / CLIPS_FILE).read_text())
    rows = json.loads((out / DATA_FILE).read_text())
    print(f"{out}: {len(rows)} rows, {len(clips)} clips, {sum(c['seconds'] for c in clips):.1f} s of audio")


if __name__ == "__main__":
    main()
