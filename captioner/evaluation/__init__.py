"""Scoring captions: BLEU/METEOR/ROUGE-L/CIDEr-D (``metrics``), attention correctness (``attention_metrics``), object words, and scoring a checkpoint on a split (``evaluate``)."""
