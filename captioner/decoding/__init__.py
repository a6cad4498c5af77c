"""Turning a model's per-step state into captions: beam search and greedy decoding, and sampling for self-critical training (``search``)."""
