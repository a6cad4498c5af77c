"""Pieces of the training loop (``captioner.train``): distributed setup, run state, data, logs.

``distributed`` wraps torchrun/process-group handling, ``state`` captures and restores RNG state
for exact resumption, ``data`` turns a ``Config`` into caption sets, vocabulary, feature caches and
DataLoaders, ``optim`` builds optimizer, schedule and mixed precision, and ``logging_utils``
writes ``metrics.csv`` (and TensorBoard when it is installed).
"""
