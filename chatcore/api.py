"""chatcore's public API for plugins: every name a decoder, steerer or prompt-format plugin
may rely on, in one place.

A plugin imports ``chatcore`` (for ``@chatcore.hookimpl``), this module, and, for a training
command, the training wing (:mod:`chatcore.training`); nothing else of chatcore and no other
plugin. The built-in plugins are held to this by import-linter contracts (``make lint``,
``[tool.importlinter]`` in pyproject.toml), so a name a built-in needs is a name a
third-party plugin can use too. Everything here stays importable without torch: the heavy
work happens inside the functions.

The names, by what a plugin author does with them:

- hooks: :data:`hookimpl`, the registration hooks' ``register`` callbacks take the classes below;
- settings: :class:`Settings` (a pydantic model; ``Field(ge=..., le=...)`` bounds and
  docstrings become the help and the error messages);
- steerers: :class:`Steerer`, the step it wraps (:data:`Step`, :class:`StepState`,
  :class:`StepOutput`), :func:`model_step`;
- decoders: :class:`Decoder`, :class:`TokenDecoder` (one token per step, with
  :class:`RepetitionSettings`), :class:`GenerationSession` (what a decoder and a steerer
  see of a reply; :func:`selects_from_scores` marks a ``select`` that picks an index of its
  scores), and candidate sampling for decoders that choose among N sampled
  replies (:class:`CandidateDecoder`, :class:`CandidateSettings`, :class:`Sampled`,
  :class:`Candidate`, :class:`ContinuationScore`, the top-k sampler they share);
- score processors, transformers' warpers behind one call (``temperature``, ``top_k`` ...);
- models: :class:`LoadedModel`, :func:`load_model`, :func:`load_tokenizer`,
  :func:`bundled_reverse_models`, and the model anatomy module's
  :func:`anatomy_of` (blocks, attention, caches of every supported architecture);
- text and words: :func:`encode_text` (never parses special tokens), word lists;
- prompts: :class:`Message`, :class:`PromptFormat`, :func:`choose_format`;
- commands: :func:`train_group`, the ``chatcore train`` group a plugin adds its training
  command to (from its ``register_commands`` hook); :func:`options_from_model`, click
  options generated from a :class:`Settings` model's fields (default, bounds, help);
  ``model_option``, the ``-m/--model`` option with the default model of chat and generate;
  :func:`output_folder`, :func:`output_file` and :func:`run_folder`, a command's ``--out``
  checked (and its folder made) before the work starts, and :func:`removed_if_left_empty`
  to take a run's folder away again when the command fails before writing in it;
- evaluation: :class:`EvalContext` (what a ``register_prompt_sets`` loader returns);
- errors: :class:`ChatcoreError` and its kinds, shown to the user in one line;
- speed: :func:`fast_path_mode`, the ``CHATCORE_FAST_PATH`` setting (under ``compile`` a
  steerer that runs passes of its own may compile them too, as PPLM does).
"""

from __future__ import annotations

from chatcore.anatomy import FULL_ATTENTION, Anatomy, BlockInputs, UnsupportedModelError, anatomy_of
from chatcore.cli.files import output_file, output_folder, removed_if_left_empty, run_folder
from chatcore.cli.options import model_option, options_from_model
from chatcore.cli.train import train_group
from chatcore.decoding import (
    Candidate,
    Decoder,
    GenerationSession,
    RepetitionSettings,
    Sampled,
    TokenDecoder,
    selects_from_scores,
)
from chatcore.errors import ChatcoreError, CorpusError, ModelLoadError, OptionError, PluginError, UnknownNameError
from chatcore.evaluation.metrics import contains_any, is_degenerate
from chatcore.evaluation.prompts import EvalContext
from chatcore.fast_path_setting import compile_failure, fast_path_mode
from chatcore.hookspecs import hookimpl
from chatcore.models import (
    BUNDLED_DIR,
    DEFAULT_MODEL,
    DEFAULT_REVERSE_MODEL,
    LoadedModel,
    bundled_reverse_models,
    cache_holding,
    cache_keyword,
    load_model,
    load_tokenizer,
    output_cache,
    plain_cache,
)
from chatcore.options import ON_THIS_MACHINE, OnThisMachine, Settings
from chatcore.processors import ScoreProcessor, min_p, temperature, top_k, top_p
from chatcore.prompting import (
    AUTO,
    Message,
    PromptFormat,
    choose_format,
    scripted_messages,
    special_token_texts,
    validate_format_name,
)
from chatcore.registry import registry_of
from chatcore.sampling import CandidateDecoder, CandidateSettings, ContinuationScore, TopKDecoder, TopKSettings
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState, model_step
from chatcore.text import encode_text, vocabulary_sha256
from chatcore.wordlists import WORDLIST_DIR, builtin_topics, check_word_sources, collect_words, read_word_file

__all__ = [
    "registry_of",
    "options_from_model",
    "model_option",
    "output_file",
    "output_folder",
    "run_folder",
    "removed_if_left_empty",
    "AUTO",
    "Anatomy",
    "BUNDLED_DIR",
    "BlockInputs",
    "Candidate",
    "CandidateDecoder",
    "CandidateSettings",
    "ChatcoreError",
    "ContinuationScore",
    "CorpusError",
    "DEFAULT_MODEL",
    "DEFAULT_REVERSE_MODEL",
    "Decoder",
    "EvalContext",
    "FULL_ATTENTION",
    "GenerationSession",
    "LoadedModel",
    "Message",
    "ModelLoadError",
    "OptionError",
    "PluginError",
    "PromptFormat",
    "RepetitionSettings",
    "Sampled",
    "ScoreProcessor",
    "Settings",
    "OnThisMachine",
    "ON_THIS_MACHINE",
    "Steerer",
    "Step",
    "StepOutput",
    "StepState",
    "TokenDecoder",
    "TopKDecoder",
    "TopKSettings",
    "UnknownNameError",
    "UnsupportedModelError",
    "WORDLIST_DIR",
    "anatomy_of",
    "builtin_topics",
    "bundled_reverse_models",
    "cache_holding",
    "cache_keyword",
    "check_word_sources",
    "choose_format",
    "collect_words",
    "contains_any",
    "encode_text",
    "fast_path_mode",
    "compile_failure",
    "hookimpl",
    "is_degenerate",
    "load_model",
    "load_tokenizer",
    "min_p",
    "model_step",
    "output_cache",
    "plain_cache",
    "read_word_file",
    "scripted_messages",
    "selects_from_scores",
    "special_token_texts",
    "temperature",
    "top_k",
    "top_p",
    "train_group",
    "validate_format_name",
    "vocabulary_sha256",
]
