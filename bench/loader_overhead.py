"""Where ODBDataLoader's own time goes with no workers at all (the engine bench's weakest row).

    python -m bench.loader_overhead [--samples N] [--repeats N]

The synthetic samples are built once and served from a list, so the dataset pipeline costs
nothing and what remains is each loader's own work, side by side in one process:
  * plain: torch's DataLoader at ODB's mean batch size;
  * ODB, costs known: ODBDataLoader with a cost function that looks each cost up (planning,
    alignment and the step bookkeeping only);
  * ODB: ODBDataLoader with the default cost function (which also reads every sample's labels).
Microseconds a sample, best of the repeats, with the identity collate and the padding collate.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import torch

from odb_factory import ODBConfig, ODBDataLoader, SampleCost
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate


class ServedSamples(torch.utils.data.Dataset):
    def __init__(self, samples: List[Dict[str, torch.Tensor]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return self.samples[index]


class KnownCost:
    """The cost of each served sample, computed once beforehand and looked up by the
    sample's identity (a dict lookup: reading the index tensor would cost more than that)."""

    def __init__(self, samples: List[Dict[str, torch.Tensor]]):
        self.by_sample = {id(s): SampleCost(len(s["input_ids"]), int((s["labels"][1:] != -100).sum()))
                          for s in samples}

    def __call__(self, sample: Dict[str, torch.Tensor]) -> SampleCost:
        return self.by_sample[id(sample)]


def identity(batch: Any) -> Any:
    return batch


def microseconds_per_sample(loader, samples: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in loader:
            pass
        best = min(best, (time.perf_counter() - start) / samples * 1e6)
    return best


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    lengths = long_tail_lengths(args.samples, cv=1.0, mean=300, seed=3, minimum=16, maximum=1024)
    samples = [LengthDataset(lengths)[i] for i in range(len(lengths))]
    dataset, known = ServedSamples(samples), KnownCost(samples)
    config = ODBConfig(token_budget=4096, buffer_size=256)   # bench.engine's synthetic workload
    lines = ["| collate | plain | ODB, costs known | ODB | ODB's planning | ODB's cost function |",
             "|---|---|---|---|---|---|"]
    for name, collate in (("identity", identity), ("padding", pad_collate)):
        odb = ODBDataLoader(dataset, config, collate_fn=collate)
        steps = [s for s in odb if not s.is_idle]
        batch = max(1, round(sum(s.num_samples for s in steps) / len(steps)))
        loaders = {"plain": torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=collate),
                   "known": ODBDataLoader(dataset, config, collate_fn=collate, cost_fn=known),
                   "odb": odb}
        us = {key: [] for key in loaders}
        for _ in range(args.repeats):  # alternate, so drift hits every loader alike
            for key, loader in loaders.items():
                us[key].append(microseconds_per_sample(loader, len(samples), 1))
        best = {key: min(v) for key, v in us.items()}
        lines.append(f"| {name} | {best['plain']:.1f} | {best['known']:.1f} | {best['odb']:.1f} | "
                     f"{best['known'] - best['plain']:+.1f} | {best['odb'] - best['known']:+.1f} |")
    text = (f"µs a sample, best of {args.repeats} alternating epochs of {len(samples)} served samples "
            "(world size 1, no workers)\n\n" + "\n".join(lines))
    print(text)
    return text


if __name__ == "__main__":
    main()
