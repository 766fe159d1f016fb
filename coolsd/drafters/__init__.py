"""Trained drafter models (EAGLE-1 feature heads) and their training recipe."""
from coolsd.drafters.eagle import (
    LLAMAGEN_T2I_DRAFTER,
    EagleConfig,
    EagleDrafter,
    EagleHead,
    head_logits,
)
from coolsd.drafters.training import (
    EagleBatch,
    TrainLog,
    eagle_loss,
    evaluate_eagle,
    llamagen_batch,
    llamagen_features,
    train_eagle,
)

__all__ = [
    "LLAMAGEN_T2I_DRAFTER", "EagleConfig", "EagleDrafter", "EagleHead", "head_logits",
    "EagleBatch", "TrainLog", "eagle_loss", "evaluate_eagle", "llamagen_batch", "llamagen_features",
    "train_eagle",
]
