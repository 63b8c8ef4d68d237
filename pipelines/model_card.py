"""A short model card saved next to the weights."""
from __future__ import annotations

from typing import Any

from pipelines.config import Config


def model_card(cfg: Config, metrics: dict[str, Any], step: int) -> str:
    results = "\n".join(f"| {k} | {v:.4f} |" for k, v in metrics.items())
    return f"""# {cfg.model.name} ({cfg.run.name})

Trained with probvlp: loss `{cfg.loss.name or 'model default'}`, {step} steps, {cfg.train.num_workers} workers x
batch {cfg.train.batch_size} (x{cfg.train.grad_accum} accumulation), DeepSpeed ZeRO-{cfg.train.zero_stage},
data `{cfg.data.source}` at {cfg.data.image_size}px.

| metric | value |
| --- | --- |
{results}

Load without unpickling code:

```python
from models.checkpoint import load_model
model = load_model("model.safetensors")  # rebuilds `{cfg.model.name}` from the registry
```

`config.yaml` in the run holds the full resolved configuration.
"""
