"""The demo: synthetic scenes, three decoders trained on a time budget, and a report (``pipeline`` runs it)."""
