"""Decoder and steerer configurations that can never make a reply, and the one line each
entry point refuses them with, when they are configured (shared by the adapters' tests)."""

from __future__ import annotations

# The modules whose decoders and steerers these configurations name.
PLUGIN_MODULES = (
    "chatcore.plugins.greedy",
    "chatcore.plugins.top_k",
    "chatcore.plugins.mmi.plugin",
    "chatcore.plugins.rank",
    "chatcore.plugins.bow_bias",
    "chatcore.plugins.pplm.plugin",
    "chatcore.plugins.cocon.plugin",
)

# (steerer specs in the order given, the line that refuses them)
IMPOSSIBLE_STEERERS = [
    (
        ("cocon content=pizza", "pplm topic=food"),
        "steerer 'pplm' edits the model's own key/value cache and cannot be combined with 'cocon', "
        "which replaces the model step",
    ),
    (
        # Whatever the order: the refusal never suggests one that would be refused too.
        ("pplm topic=food", "cocon content=pizza"),
        "steerer 'pplm' edits the model's own key/value cache and cannot be combined with 'cocon', "
        "which replaces the model step",
    ),
    (
        ("bow-bias topic=food", "cocon content=pizza"),
        "steerer 'cocon' replaces the model step, so it must come first (give it before 'bow-bias')",
    ),
]
# Two instances of one steerer: only where a steerer named again is added, not replaced
# (the command line, HTTP and the Python API; /steer NAME changes the settings of NAME).
REPEATED_STEERERS = [
    (
        ("cocon content=pizza", "cocon content=dogs"),
        "steerers 'cocon' and 'cocon' both replace the model step: give only one of them",
    ),
    (
        ("pplm topic=food", "pplm topic=sports"),
        "steerers 'pplm' and 'pplm' both edit the model's own key/value cache: give only one of them",
    ),
]

# (decoder spec, the line that refuses it): settings whose scores overflow.
NON_DECODABLE_DECODERS = [
    ("top-k temperature=1e-300", "decoder 'top-k': `temperature` must be between 1e-15 and 1e+38, got 1e-300"),
    ("top-k temperature=1e300", "decoder 'top-k': `temperature` must be between 1e-15 and 1e+38, got 1e+300"),
    (
        "greedy repetition_penalty=1e-300",
        "decoder 'greedy': `repetition_penalty` must be a number of at least 1e-15, got 1e-300",
    ),
    ("rank topic=food temperature=1e-45", "decoder 'rank': `temperature` must be between 1e-15 and 1e+38, got 1e-45"),
    ("mmi weight=1e300", "decoder 'mmi': `weight` must be between 0 and 1e+100, got 1e+300"),
    (
        "mmi selection=sample selection_temperature=1e-300",
        "decoder 'mmi': `selection_temperature` must be a number of at least 1e-100, got 1e-300",
    ),
]
