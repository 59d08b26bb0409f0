"""The ``mmi`` decoder's package: maximum mutual information reranking (the DialoGPT paper).

- :mod:`chatcore.plugins.mmi.plugin`     the decoder and its settings, registered through
  ``register_decoders``;
- :mod:`chatcore.plugins.mmi.reranking`  forward and reverse (MMI) scores of candidate
  replies, batched, and the reverse model's tokenizer check.

The reverse model is trained by ``chatcore train model --reverse``; see docs/mmi.md.
"""
