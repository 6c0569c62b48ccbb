"""``elastic.train.torch``: Ray Train's ``ray.train.torch`` names on this platform."""

from elastic.train.torch.prepare import (
    get_device,
    get_devices,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
)
from elastic.train.torch.trainer import TorchTrainer

__all__ = [
    "TorchTrainer",
    "get_device",
    "get_devices",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
]
