"""Showing where each word looked: overlay images (``overlays``), the HTML explorer, the attention record, and heat-map maths."""
