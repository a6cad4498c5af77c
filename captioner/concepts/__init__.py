"""Concept detectors, the labels the encoder sees, and the decoders' reading of them: one optional
extension behind one seam.

A vertical slice through the layers, each module at the level of what it joins:

* ``captioner.concepts.model`` (model layer): the detector head and its files, the decoder extension
  (``SATConcepts``, ``TransformerConcepts``) the registry builds from the model config's ``concepts``
  section, and the tags a caption shows (``photo_tags``);
* ``captioner.concepts.labels`` (model layer): the labels the encoder sees, its ImageNet head read
  through a hand-written lexicon (``imagenet_lexicon.tsv``) as words with a class activation map each;
* ``captioner.concepts.training`` (training layer): the ``captioner concepts`` job, the one hook that
  joins a concepts file to a training run, and the concept terms of its loss.

The papers' decoders (``captioner.models.lstm``, ``captioner.models.transformer``) never import this
package: they call their extension at the points ``captioner.models.base`` declares.
"""
