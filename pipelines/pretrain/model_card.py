"""A short model card saved next to the weights."""
from __future__ import annotations

from typing import Any

from pipelines.pretrain.config import TrainDocument


def model_card(cfg: TrainDocument, metrics: dict[str, Any], step: int) -> str:
    results = "\n".join(f"| {k} | {v:.4f} |" for k, v in metrics.items())
    return f"""# {cfg.model.name} ({cfg.run.name})

Trained with probvlp: loss `{cfg.loss.name or 'model default'}`, {step} steps, {cfg.train.num_workers} workers x
batch {cfg.train.batch_size} (x{cfg.train.grad_accum} accumulation), DeepSpeed ZeRO-{cfg.train.zero_stage},
data `{cfg.data.source}` at {cfg.data.image_size}px.

| metric | value |
| --- | --- |
{results}

Load it anywhere as an MLflow model (images and / or captions in, mu and sigma^2 out):

```python
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model("runs:/<run_id>/model")
model.predict(pd.DataFrame({{"image": [open("cat.jpg", "rb").read()], "caption": ["a photo of a cat"]}}))
```

or over REST (`mlflow models serve -m runs:/<run_id>/model --env-manager local`), images as base64 text and null
where a row has no such input; a row that cannot be read is answered with HTTP 400 naming its index and why:

```bash
curl -X POST http://127.0.0.1:5000/invocations -H "Content-Type: application/json" -d '{{"dataframe_split":
  {{"columns": ["image", "caption"], "data": [["'"$(base64 -w0 cat.jpg)"'", null], [null, "a photo of a cat"]]}}}}'
```

or as the PyTorch module, without unpickling code:

```python
from models.model_file import load_model
model = load_model("data/model.safetensors")  # rebuilds `{cfg.model.name}` from the registry
```

`config.yaml` in the run holds the full resolved configuration.
"""


def summary_table(metrics: dict[str, Any]) -> str:
    """The final `{task}/{metric}` numbers as a markdown table, one row per task and metric."""
    rows = []
    for key in sorted(metrics):
        task, _, name = key.partition("/")
        value = metrics[key]
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        rows.append(f"| {task} | {name} | {shown} |")
    return "| task | metric | value |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
