"""Turning a model's per-step state into captions: beam search and greedy decoding (``search``), sampling for self-critical training (``sampling``)."""
