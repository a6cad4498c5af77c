"""Pieces of the training loop (``captioner.training.loop``): distributed setup, run state, data, logs.

``distributed`` wraps torchrun/process-group handling, ``state`` captures and restores RNG state
for exact resumption, ``data`` turns a ``Config`` into caption sets, vocabulary, feature caches and
DataLoaders, ``optim`` builds optimizer, schedule and mixed precision (and guards steps against
non-finite gradients), ``validation`` decodes and scores the validation set, and ``logging_utils``
writes ``metrics.csv`` (and TensorBoard when it is installed). The loop itself is ``loop`` (build a
run, run its epochs), ``run`` (what one run holds), ``step`` (one training step) and ``epoch`` (one
epoch, validation, the end-of-epoch save).
"""
