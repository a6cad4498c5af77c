"""Dataset downloads behind ``captioner download flickr8k|coco``.

``archives`` holds what both datasets share (the ``prepare`` loop over archives, zip extraction
that never writes outside the destination); ``flickr8k`` and ``coco`` describe each dataset's
archives and layout. The HTTP transfer itself (resume, checksum) is :mod:`captioner.download`.
"""
