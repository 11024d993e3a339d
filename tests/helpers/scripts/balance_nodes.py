"""Run by torchrun (2 nodes x 2 ranks on localhost) from tests/loader/test_step_rebalancing.py."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.comm import object_exchange as exchange
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

N = 173
sent_log = []
_original = exchange.exchange_objects


def _recording(sync, outgoing, what, epoch, round):
    incoming, sent = _original(sync, outgoing, what, epoch, round)
    sent_log.append(sent)
    return incoming, sent


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from odb_factory.loader import step_rebalancer
    step_rebalancer.exchange_objects = _recording
    ds = LengthDataset(long_tail_lengths(N, cv=1.0, mean=60, seed=13, maximum=700))
    loader = ODBDataLoader(ds, ODBConfig(token_budget=768, buffer_size=24, balance=True,
                                         balance_mode="min_move"), collate_fn=pad_collate)
    indices, intra, inter = [], 0.0, 0.0
    for step in loader:
        indices += step.indices
        intra += step.metrics.get("balance_bytes_intra_node", 0.0)
        inter += step.metrics.get("balance_bytes_inter_node", 0.0)
    node = rank // 2
    own = sum(sent[d] for sent in sent_log for d in range(len(sent)) if d // 2 == node)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "indices": indices, "intra": intra, "inter": inter, "num_samples": N,
        "sent_total": float(sum(map(sum, sent_log))), "own_node_sent": float(own),
        "ranks_per_node": loader._rebalancer().spec.ranks_per_node}))
    assert intra == own, (intra, own)
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
