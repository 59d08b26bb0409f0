"""PPLM: steering a frozen model by gradient steps on its past keys and values.

Plug and Play Language Models (Dathathri et al., ICLR 2020), for chat as in Madotto et
al. (2020), rebuilt on transformers' caches so that each new token costs a fixed number
of one-token forward (and backward) passes, whatever the history's length.

- :mod:`chatcore.plugins.pplm.attribute`  what to steer towards: a bag of words or a
  discriminator head (the attribute model contract, saving and loading heads);
- :mod:`chatcore.plugins.pplm.perturb`    the perturbation of the past, one decoding step at a time;
- :mod:`chatcore.plugins.pplm.loop`       its gradient iterations (loss, normalised steps), written once;
- :mod:`chatcore.plugins.pplm.passes`     the runner interface the step and the loop work through, with
  its two runners: :mod:`chatcore.plugins.pplm.model_passes` (the inner step, dense deltas) and
  :mod:`chatcore.plugins.pplm.lean_passes` (the lean runner, low-rank deltas);
- :mod:`chatcore.plugins.pplm.hidden`     the discriminator's mean hidden state of the reply;
- :mod:`chatcore.plugins.pplm.runner`     a lean one-token forward for GPT-2 and Llama-family models,
  from the past as tensors (its blocks in :mod:`chatcore.plugins.pplm.layers`, its attention in
  :mod:`chatcore.plugins.pplm.attention`);
- :mod:`chatcore.plugins.pplm.deltas`     key/value deltas, dense and low-rank;
- :mod:`chatcore.plugins.pplm.kv`         key/value caches as plain tensors and back, a growing past;
- :mod:`chatcore.plugins.pplm.train_discriminator`  training a head on a frozen model.

The steerer and its settings are the plugin module, :mod:`chatcore.plugins.pplm.plugin`;
``chatcore train discriminator`` is :mod:`chatcore.plugins.pplm.commands`; the bundled
heads are package data (``heads/``).
See docs/pplm.md.
"""
