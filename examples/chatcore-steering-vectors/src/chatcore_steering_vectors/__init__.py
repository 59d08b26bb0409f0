"""Steering vectors for chatcore: the ``activation-addition`` steerer.

chatcore finds this package through its ``chatcore`` entry point (see pyproject.toml)
and calls the hook below when it builds its registry of steerers.
"""

from __future__ import annotations

from collections.abc import Callable

import chatcore
from chatcore_steering_vectors.steerer import ActivationAddition, ActivationAdditionSettings

__all__ = ["ActivationAddition", "ActivationAdditionSettings", "register_steerers"]


@chatcore.hookimpl
def register_steerers(register: Callable[[type], None]) -> None:
    register(ActivationAddition)
