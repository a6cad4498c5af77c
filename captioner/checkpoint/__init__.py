"""Saving and loading checkpoints: the safetensors format and release files (``format``), atomic writes, the weights + config + vocabulary (``store``)."""
