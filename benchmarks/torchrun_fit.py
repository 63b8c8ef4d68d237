"""The reference for benchmarks/startup.py: the demo's model and loss trained the way open_clip starts, with no Ray,
no DeepSpeed and no MLflow. `torchrun --standalone --nproc_per_node 2 -m benchmarks.torchrun_fit ROOT STEPS`: DDP
over gloo, each rank reading its share of ROOT/train/*.tar with webdataset in one DataLoader worker, the same image
decoding, caption mix and tokenizer as the product's reader, AdamW, one torch thread per rank. Rank 0 prints
`[torchrun] first step done` once its first step is done, then trains to STEPS."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds

from models.objective import build_objective
from models.preprocess import decode_image, resize, to_model_input
from models.tokenizer import tokenize
from pipelines.pretrain.config import load_train_config
from pipelines.data.captions import CaptionSampler

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "prolip_demo.yaml"


class Samples:
    """(image as model input, tokens) of a webdataset sample, with the demo's caption mix."""

    def __init__(self, cfg, context_length: int, seed: int):
        d = cfg.data
        self.size, self.context_length = d.image_size, context_length
        self.captions = CaptionSampler(d.mid_caption_prob, d.general_caption_prob, d.instance_caption_prob)
        self.rng = np.random.default_rng(seed)

    def __call__(self, sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
        image = decode_image(sample["jpg"])
        caption = self.captions.draw(json.loads(sample["json"]), sample["txt"].decode(), self.rng)
        return (torch.from_numpy(to_model_input(resize(image, self.size)[None])[0]),
                tokenize([caption], self.context_length)[0])


def main(root: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_train_config(CONFIG, [])
    torch.manual_seed(cfg.run.seed)
    objective = build_objective(cfg).train()
    model = torch.nn.parallel.DistributedDataParallel(objective)
    t = cfg.train
    optimizer = torch.optim.AdamW(objective.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay)
    shards = sorted(str(p) for p in Path(root, "train").glob("*.tar"))
    # each rank its own shards (open_clip splits them by node the same way)
    data = (wds.WebDataset(shards[rank::world] or shards, shardshuffle=False, empty_check=False, nodesplitter=None).repeat()
            .shuffle(4 * t.batch_size).map(Samples(cfg, objective.model.context_length, cfg.run.seed + rank))
            .batched(t.batch_size, partial=False))
    loader = wds.WebLoader(data, batch_size=None, num_workers=1)
    first = True
    for step, (images, tokens) in enumerate(loader, start=1):
        loss = model(images, tokens)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(objective.parameters(), t.grad_clip)
        optimizer.step()
        if first and rank == 0:
            print(f"[torchrun] first step done at {time.time():.3f}", flush=True)
        first = False
        if step >= steps:
            break
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # the DataLoader worker of an endless stream: nothing left to flush


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
