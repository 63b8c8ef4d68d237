"""Pure-PyTorch models, losses and formulas. Importing this package registers every model."""
from models import clip, llip, pcmepp, prob_llip, prolip  # noqa: F401  (registers models)
from models.registry import create_model, default_loss, list_models

__all__ = ["create_model", "default_loss", "list_models"]

