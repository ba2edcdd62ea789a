"""Checkpoints: training state (`save`/`load`) and model weights as safetensors."""

from headroom.checkpoint._checkpoint import CheckpointCorruptError, load, save
from headroom.checkpoint._weights import load_weights, save_weights

__all__ = ["CheckpointCorruptError", "load", "load_weights", "save", "save_weights"]
