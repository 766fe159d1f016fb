"""Trained drafter models (EAGLE-1 feature heads) and their training recipe."""
from coolsd.models.eagle.lumina import (
    LUMINA_MGPT_DRAFTER,
    LuminaEagleConfig,
    LuminaEagleDrafter,
    LuminaEagleHead,
    load_lumina_eagle_head,
)
from coolsd.models.eagle.model import (
    LLAMAGEN_T2I_DRAFTER,
    EagleConfig,
    EagleDrafter,
    EagleHead,
    head_logits,
)
from coolsd.models.eagle.training import (
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
    "train_eagle", "LUMINA_MGPT_DRAFTER", "LuminaEagleConfig", "LuminaEagleDrafter", "LuminaEagleHead",
    "load_lumina_eagle_head",
]
