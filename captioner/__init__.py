"""captioner: image captioning with visual attention (Show, Attend and Tell; Transformer).

Importing the package is light: torch, timm, matplotlib and pycocotools load only when used.
"""

__version__ = "0.1.0"
