"""Pure-PyTorch models, losses and formulas.

`from models import create_model` imports the registry (and with it every model class, timm included);
`import models.preprocess` or `models.tokenizer` alone does not, which keeps Ray Data workers light."""
from __future__ import annotations

__all__ = ["create_model", "default_loss", "list_models"]


def __getattr__(name: str):
    if name in __all__:
        from models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
