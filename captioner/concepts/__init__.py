"""Concept detectors, the labels the encoder sees, and the decoders' reading of them: one optional
extension behind one seam, a vertical slice through the layers (``model`` and ``labels`` in the model
layer, ``training`` in the training layer). The papers' decoders never import this package: they call
their extension at the points ``captioner.models.base`` declares.
"""
