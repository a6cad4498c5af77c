"""Saving and loading checkpoints: the safetensors format (``format``), atomic writes, the weights + config + vocabulary (``store``)."""
