"""The ``pplm`` steerer: Plug and Play Language Models on the past keys and values.

A bag of words (``topic=``, ``words=``, ``file=``) or a discriminator head
(``discriminator=`` + ``class_label=``) sets the goal; gradient steps on the cache move
the model towards it, one token at a time (see chatcore.plugins.pplm.perturb and docs/pplm.md).
Also registers ``chatcore train discriminator`` (:mod:`chatcore.plugins.pplm.commands`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import model_validator

import chatcore
from chatcore.api import (
    OnThisMachine,
    OptionError,
    Steerer,
    Step,
    builtin_topics,
    check_word_sources,
    collect_words,
)

from .config import PerturbConfig

if TYPE_CHECKING:
    from chatcore.api import GenerationSession, LoadedModel

    from .perturb import Perturbation


class PPLMSettings(PerturbConfig):
    """The attribute (words, a topic, a word file, or a discriminator head and its class)
    and the perturbation's knobs."""

    topic: str | None = None
    """A built-in word list (food, sports, ...)."""
    words: tuple[str, ...] = ()
    """Words or phrases (comma list)."""
    file: Annotated[str | None, OnThisMachine("word file")] = None
    """A word file, one word or phrase per line."""
    discriminator: Annotated[str | None, OnThisMachine("head file")] = None
    """A discriminator head: a bundled name or a folder (`chatcore train discriminator`)."""
    class_label: str | None = None
    """The discriminator's class to steer towards."""

    @model_validator(mode="after")
    def _one_attribute(self) -> PPLMSettings:
        check_word_sources(self.topic, self.file)
        has_words = bool(self.topic or self.file or any(w.strip() for w in self.words))
        if self.discriminator is not None:
            from .attribute import read_head_config, resolve_head

            if has_words:
                raise ValueError("give either words (`topic`, `words`, `file`) or a `discriminator`, not both")
            if self.class_label is None:
                raise ValueError("`class_label` is needed with a `discriminator`")
            read_head_config(resolve_head(self.discriminator)).class_index(self.class_label)
        elif self.class_label is not None:
            raise ValueError("`class_label` is only used with a `discriminator`")
        elif not has_words:
            raise ValueError(
                "pplm needs an attribute: `topic=NAME`, `words=a,b,c`, `file=PATH`, "
                "or `discriminator=NAME|PATH class_label=LABEL`"
            )
        return self

    def all_words(self) -> list[str]:
        return collect_words(self.words, self.topic, self.file)

    def perturb_config(self) -> PerturbConfig:
        return PerturbConfig(**{name: getattr(self, name) for name in PerturbConfig.model_fields})


class PPLMSteerer(Steerer):
    runs_beside = True  # its passes and gradients use its own cache and perturbations only
    name = "pplm"
    description = "gradient steps on the key/value cache towards a bag of words or a discriminator class (PPLM)"
    Settings = PPLMSettings
    needs_model_cache = True

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        if name == "topic":
            return builtin_topics()
        if name == "discriminator":
            from .attribute import builtin_heads

            return builtin_heads()
        return super().setting_choices(name)

    def __init__(self, settings: PPLMSettings | None = None) -> None:
        super().__init__(settings)
        self.perturbation: "Perturbation | None" = None

    @classmethod
    def setup(cls, model: "LoadedModel", settings: PPLMSettings) -> Any:
        """The discriminator head, loaded and checked against the model once per engine (a
        head trained for another model is refused when pplm is chosen, not at its first
        reply); None for a bag of words. The head is read-only: every reply shares it."""
        from .attribute import load_head

        if settings.discriminator is None:
            return None
        assert settings.class_label is not None
        return load_head(
            settings.discriminator, model.model, model.tokenizer, model.name, settings.class_label, device=model.device
        )

    def prepare(self, session: "GenerationSession") -> None:
        from .attribute import AttributeModel, BagOfWords
        from .perturb import Perturbation

        loaded = session.model
        settings: PPLMSettings = self.settings
        attribute: AttributeModel
        if settings.discriminator is not None:
            attribute = self.shared if self.shared is not None else self.setup(loaded, settings)
        else:
            vocab_size = loaded.model.get_output_embeddings().weight.size(0)
            attribute = BagOfWords.from_words(settings.all_words(), loaded.tokenizer, vocab_size, loaded.device)
        self.perturbation = Perturbation(
            settings.perturb_config(),
            attribute,
            loaded.model,
            loaded.eos_token_id,
            runner=self._runner(session),
            max_new_tokens=session.max_new_tokens,
        )
        self.note(session, self.perturbation.summary)

    def _runner(self, session: "GenerationSession") -> Any:
        """The lean forward for the perturbed passes, if it computes what the inner step
        does: a GPT-2 or Llama-family model (:func:`chatcore.plugins.pplm.runner.supports`), and no
        other steerer between PPLM and the model (steerers listed before this one are inside
        it, and their edits must take part)."""
        from . import runner

        steerers = list(session.steerers)
        innermost = bool(steerers) and steerers[0] is self
        if not innermost or not runner.supports(session.model.model):
            return None
        return runner.Runner(session.model.model)

    def wrap(self, step: Step) -> Step:
        if self.perturbation is None:
            raise OptionError("steerer 'pplm' was used before prepare(session)")
        return self.perturbation.wrap(step)


@chatcore.hookimpl(trylast=True)
def register_steerers(register: Callable[[type], None]) -> None:
    register(PPLMSteerer)


@chatcore.hookimpl
def warm_up_steerers(model: LoadedModel) -> list[tuple[str, dict[str, Any]]] | None:
    """Under ``CHATCORE_FAST_PATH=compile`` PPLM's runner compiles its layers at their first
    steered reply (:mod:`chatcore.plugins.pplm.compiled`): a server runs one before it takes
    requests. Nothing to warm up otherwise, or where the runner cannot run the model (PPLM
    then runs the model's own passes)."""
    from chatcore.api import fast_path_mode

    if fast_path_mode() != "compile":
        return None
    from .runner import unsupported_reason

    if unsupported_reason(model.model) is not None:
        return None
    return [("pplm", {"topic": "food"})]


@chatcore.hookimpl(trylast=True)
def register_commands(cli: Any) -> None:
    from chatcore.api import train_group

    from .commands import train_discriminator_command

    train_group(cli).add_command(train_discriminator_command)
