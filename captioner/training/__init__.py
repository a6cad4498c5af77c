"""Training: ``captioner.training.loop.train(cfg, out_dir)`` and the parts it is made of, one idea per module.

``loop`` builds a run and runs its epochs (validation, the end-of-epoch save, starting from a
checkpoint's weights, the objective chosen by name); ``run`` is what one run holds and saves (its
folder, progress, random-generator states, resume checks, ``metrics.csv``, the selection metric);
``step`` is one training step (eager, or captured as a CUDA graph) and what to do with non-finite
values; ``optim`` the optimiser, its learning-rate schedules and decays and mixed precision;
``objective`` the objectives' interface, the cross-entropy with its regularisers and the attention
supervision by object boxes; ``scst`` self-critical training (sampling and the CIDEr-D reward);
``data`` caption sets, vocabulary, feature caches, DataLoaders and in-memory batches;
``detectors`` the encoder's word-detector pretraining (torchrun's process group is
``captioner.device``). The concept detectors' training and their hook into a run are ``captioner.concepts.training``.
"""
