"""Pure-PyTorch models, losses and formulas. The model modules register themselves when the registry is
first asked for a model, so `import models.preprocess` (Ray Data workers) does not pull in the towers."""
from models.registry import create_model, default_loss, list_models

__all__ = ["create_model", "default_loss", "list_models"]
