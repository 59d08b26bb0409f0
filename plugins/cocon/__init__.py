"""CoCon: content-conditioned generation by a trained block between two layers of a frozen model.

CoCon (Chan et al., ICLR 2021) routes the hidden states after layer ``alpha`` through a
small transformer block that attends to the encoded content as well as to the text, then
lets the rest of the model run on. This package holds the plugin and everything it needs:

- :mod:`chatcore.plugins.cocon.plugin`       the ``cocon`` steerer and its settings;
- :mod:`chatcore.plugins.cocon.commands`     ``chatcore train cocon``;
- :mod:`chatcore.plugins.cocon.block`        the CoCon block and its config;
- :mod:`chatcore.plugins.cocon.model_split`  a model cut at the block's layer (any architecture
  the anatomy module knows);
- :mod:`chatcore.plugins.cocon.pipeline`     a decoding step through the block, its cache;
- :mod:`chatcore.plugins.cocon.store`        saving, finding and checking trained blocks;
- :mod:`chatcore.plugins.cocon.training`     training a block (self, cycle, null and adversarial
  losses in :mod:`chatcore.plugins.cocon.losses`; windows of dialogue in
  :mod:`chatcore.plugins.cocon.windows`; held-out losses in :mod:`chatcore.plugins.cocon.heldout`).

See docs/cocon.md.
"""
