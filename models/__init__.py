"""Pure-PyTorch models, losses and formulas. Importing this package registers every model."""
from models import clip, llip_model, pcmepp, prob_llip, probvlm, prolip  # noqa: F401  (registers models)
from models.registry import create_model, default_loss, list_models

__all__ = ["create_model", "default_loss", "list_models"]

