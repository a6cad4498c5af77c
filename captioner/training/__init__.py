"""Training: ``captioner.training.loop.train(cfg, out_dir)`` and its parts, one idea per module.

``loop`` (the run's epochs, validation, saves, ``--init``), ``run`` (what a run holds and saves),
``step`` (one training step, eager or a CUDA graph), ``optim`` (optimiser, schedules, precision),
``objective`` (cross-entropy and its terms), ``attention_terms`` (box supervision), ``scst``
(self-critical training), ``distill`` (distillation), ``data`` (datasets and loaders) and
``detectors`` (the demo encoder's word-detector pretraining).
"""
