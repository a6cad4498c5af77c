"""Sharing and showing a trained model: the Hub-ready export with its model card (``model_card``),
and the local web page of ``captioner serve`` (``server``, with its example pictures, and ``page``)."""
