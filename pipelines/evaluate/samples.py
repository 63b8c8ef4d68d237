"""A few held-out images with what the trained model makes of them, for the end of `jobs.pretrain`: worked out on
rank 0 beside the final evaluation (its model and its eval data, on any node), printed by the driver."""
from __future__ import annotations

import torch

from models.preprocess import to_device
from pipelines.config import EvalTask
from pipelines.evaluate.in_process import embed_texts, model_device, on_device, split_captions, task_texts
from pipelines.evaluate.tasks import classes_from_prompts, sigma2


def showcase_task(tasks: list[EvalTask]) -> EvalTask | None:
    """The first zero-shot task, else the first retrieval task (a loss task has nothing to show)."""
    return next((t for t in tasks if t.kind == "zeroshot"), next((t for t in tasks if t.kind == "retrieval"), None))


@torch.no_grad()
def sample_predictions(model: torch.nn.Module, task: EvalTask, batch: dict, n: int = 4) -> list[str]:
    """Lines naming, for the first `n` images of a decoded eval batch, the class (zero-shot) or caption (retrieval)
    the model scores best, with the image's and that class's prompts' sigma^2 for a probabilistic model."""
    device = model_device(model)
    image = model.encode_image(to_device(torch.as_tensor(batch["image"][:n]), device))
    captions = split_captions(batch["captions"][:n])
    texts, counts, classnames = task_texts(task, captions)
    counts = counts or [1] * len(texts)
    labels = classnames or texts
    text = embed_texts(model, texts)
    scores = model.class_scores(image, on_device(classes_from_prompts(model, text, counts), device)).float().cpu()
    image = {k: v.float().cpu() for k, v in image.items()}
    best = scores.argmax(dim=1).tolist()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    lines = [f"sample predictions: {len(best)} held-out images of eval task {task.name!r} ({task.kind})"]
    if model.probabilistic:
        lines.append("  sigma^2: mean per-dimension variance; larger = less certain")
    image_s2 = sigma2(image) if model.probabilistic else None
    text_s2 = sigma2(text) if model.probabilistic else None
    for i, j in enumerate(best):
        cls = int(batch["cls"][i])
        truth = classnames[cls] if classnames and 0 <= cls < len(classnames) else (captions[i][0] if captions[i] else "?")
        line = f"  image {batch['key'][i]} (true: {truth!r}) -> {labels[j]!r}"
        if image_s2 is not None:
            prompts_s2 = text_s2[starts[j] : starts[j] + counts[j]].mean()
            line += f" | sigma^2 image {image_s2[i]:.4g}, its class prompts {prompts_s2:.4g}"
        lines.append(line)
    if not model.probabilistic:
        lines.append(f"  (no sigma^2: {type(model).__name__} is a deterministic model)")
    return lines
