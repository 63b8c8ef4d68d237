"""Pure-PyTorch models, losses and formulas. Importing this package registers every model (models.registry)."""
from models.registry import create_model, default_loss, list_models

__all__ = ["create_model", "default_loss", "list_models"]
