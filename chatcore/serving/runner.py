"""The runner: the one place where replies are decoded.

Every reply, whoever asked for it (``Engine.respond``, ``generate``, ``eval``, the REPL,
Discord, HTTP), is a :class:`Job` of a :class:`Runner`: its rows (1, or a decoder's
candidates) advance together, one step per :meth:`Runner.step`:

    the reply's step (the model, wrapped by its steerers: chatcore.steering)
      -> restrict_scores (banned tokens; stop tokens before min_new_tokens)
      -> the decoder's processors -> its select (the reply's seeded generator)
      -> append -> stop? (a stop token per row; the decoder's ``enough``; the budget)

A one-row reply streams each token to its sink as it is chosen; a reply of several rows
is sent whole once the decoder has chosen its row (:meth:`Decoder.choose`).

Where a reply's rows run:

- **the shared batch** (continuous batching): replies whose steerers all edit scores
  only (``shares_batch``). Their prompt is run on its own (in chunks when it is long,
  starting after the longest prefix the prefix cache holds); then their rows join one
  merged key/value cache, and each step is one forward pass for every row of every such
  reply. Each reply's steerers then see that reply's rows of the pass: their inner step
  hands it back instead of running the model.
- **eagerly, beside it**: replies with a step steerer (PPLM, CoCon, activation steering
  ...), which re-runs the model, edits the cache or reads hidden states. Such a reply
  keeps a cache of its own and its composed step runs the model for its rows, outside
  inference mode (PPLM takes gradients). While shared rows are decoding, each such step
  runs on the runner's worker thread and the batch does not wait for it: the reply takes
  its next token when its step is done, at the start of a later :meth:`Runner.step`, and
  a slow step (PPLM's several passes) slows that reply alone. With no shared rows, its
  steps run on the calling thread.

Either way a reply's steerers see the same states (see :class:`chatcore.step.StepState`
and docs/hooks.md, "What a steerer sees"): all the reply's rows, in their order, every
call; the whole prompt in ``sequences`` at step 0, then one token per step; rows that
have ended are fed EOS until the reply ends.

A failure is the reply's alone (a one-line ChatcoreError naming the model, steerer or
decoder at fault), except the shared pass failing, which ends every shared reply.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from chatcore.decoding import Sampled, marked_from_scores, restrict_scores, to_device, within
from chatcore.errors import ChatcoreError, OptionError, PluginError
from chatcore.models import cache_holding, output_cache, plain_cache
from chatcore.processors import chain, rowwise_signature
from chatcore.serving.ahead import Ahead, TokenRead
from chatcore.serving.jobs import Faults, Job, PlainFaults, Sink
from chatcore.serving.logprobs import chosen_logprobs
from chatcore.serving.packed_prompts import packed_prompts
from chatcore.serving.prefix_cache import PrefixCache, common_length
from chatcore.serving.prompt_pass import prompt_pass
from chatcore.serving.shared_batch import SharedBatch
from chatcore.steering import LAYER_ATTRIBUTE, compose, failed_layer, scores_spoiled_by
from chatcore.step import Step, StepOutput, StepState, model_step

if TYPE_CHECKING:
    import torch

    from chatcore.decoding import Decoder, GenerationSession
    from chatcore.models import LoadedModel


DEFAULT_PREFILL_CHUNK = 256

# Whether a model's caches can be stacked, found once per model (a one-token pass).
_MERGEABLE: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


class Runner:
    """Decodes jobs: the shared batch and the eager replies beside it, one step at a time.

    Not thread-safe: one thread adds jobs and calls :meth:`step` (the scheduler's, or the
    caller's for a reply decoded on its own). The runner's own worker thread runs eager
    replies' steps beside the batch; their results are taken on the calling thread.
    """

    def __init__(
        self,
        loaded: "LoadedModel",
        faults: Faults | None = None,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.loaded = loaded
        self.faults: Faults = faults or PlainFaults()
        self.model = loaded.model
        self.device = loaded.device
        self.prefix_cache = prefix_cache
        # A longer new prompt is run this many tokens per step, so the batch never waits long
        # for it (None: at once, for a runner that decodes one reply).
        self.prefill_chunk = prefill_chunk
        self.jobs: list[Job] = []
        self.batch = SharedBatch(self.model, self.device)
        self._model_step = model_step(self.model)
        # A shared reply's prompt: compiled under CHATCORE_FAST_PATH=compile (chatcore.serving.prompt_pass).
        compiled = prompt_pass(self.model) if self.batch.fast_path else None
        self._prompt_step = self._model_step if compiled is None else model_step(self.model, compiled)
        # The fewest prompt tokens a shared reply's prompt pass runs after a cached prefix or a
        # long prompt's chunks: compiled, a pass over one token would be a graph of its own
        # (compiled in the middle of serving), so two are left; one otherwise.
        self.prompt_rest = 1 if compiled is None else 2
        self._can_merge: bool | None = None
        self._deferred: set[Job] = set()  # replies whose prompt waits a step (see _prefill_together)
        self.steps = 0  # forward passes of the shared batch (for tests and benchmarks)
        self.width = scores_width(self.model)
        self.packed_prefills = 0  # passes that read several prompts at once (for tests and benchmarks)
        self._eager: dict[Job, concurrent.futures.Future[tuple[StepOutput, torch.Tensor]]] = {}  # steps under way
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        # Queue the shared batch's next pass before reading a step's tokens, where the batch
        # takes the fast path (chatcore.serving.ahead): on a GPU, which runs it meanwhile; on
        # the CPU nothing runs meanwhile and the pass after a reply's last token is lost.
        self.run_ahead = str(self.device).startswith("cuda")
        self._ahead: Ahead | None = None  # the pass run ahead, used at the next step
        self.ahead_steps = 0  # of ``steps``, the passes run ahead (for tests and benchmarks)

    def __len__(self) -> int:
        return len(self.jobs)

    def prefilling(self) -> list[Job]:
        """Shared jobs whose long prompt is being read in chunks."""
        return [job for job in self.jobs if job.shared and job.generated == 0 and job.prefilled > 0]

    # -- adding a reply ----------------------------------------------------------------
    def add(
        self,
        sink: Sink,
        session: "GenerationSession",
        decoder: "Decoder",
        provenance: dict[str, Any] | None = None,
        observer: Callable[["torch.Tensor"], None] | None = None,
    ) -> Job:
        """Start decoding a reply into ``sink``: ``session`` (its steerers prepared:
        ``Engine.start_session``) with ``decoder``, noting in ``provenance``; ``observer``,
        if given, sees each step's (rows,) chosen tokens. The decoder's ``prepare`` runs
        here; a failure raises a one-line ChatcoreError and adds nothing."""
        import torch

        faults = self.faults
        faults.guard(decoder, "prepare", lambda: decoder.prepare(session))
        rows = faults.guard(decoder, "rows", decoder.rows)
        if not isinstance(rows, int) or rows < 1:
            raise ChatcoreError(f"decoder {decoder.name!r} asked for {rows!r} rows: a positive integer is needed")
        listed = faults.guard(decoder, "processors", decoder.processors)
        processors = chain(listed)
        prompt = list(session.prompt_ids)
        if not prompt:
            raise ChatcoreError("cannot decode from an empty prompt")
        total = len(prompt) + session.max_new_tokens
        device = self.device
        sequences = torch.full((rows, total), self.loaded.eos_token_id, dtype=torch.long, device=device)
        sequences[:, : len(prompt)] = to_device(prompt, device)
        if rows == 1:  # a one-row reply ends at its stop token: every column it writes counts
            attention = torch.ones((rows, total), dtype=torch.long, device=device)
        else:
            attention = torch.zeros((rows, total), dtype=torch.long, device=device)
            attention[:, : len(prompt)] = 1
        job = Job(
            sink=sink,
            session=session,
            decoder=decoder,
            provenance=provenance if provenance is not None else {},
            rows=rows,
            processors=processors,
            sequences=sequences,
            attention=attention,
            finished=torch.zeros(rows, dtype=torch.bool, device=device),
            stops=within(session.stop_ids, self.width, device),
            banned=within(session.banned_token_ids, self.width, device),
            width=self.width,
            shared=self._shareable(session),
            beside=all(steerer.runs_beside for steerer in session.steerers),
            stop_set=session.stop_ids,
            length=len(prompt),
            prompt_length=len(prompt),
            observer=observer,
            logprobs=[] if session.logprobs is not None else None,
        )
        if rows > 1:
            job.totals = torch.zeros(rows, dtype=torch.float64, device=device)
            job.counts = torch.zeros(rows, dtype=torch.long, device=device)
        elif session.logprobs is None and (signature := rowwise_signature(listed)) is not None:
            banned = tuple(sorted(session.banned_token_ids))
            job.lane = (type(decoder), signature, tuple(sorted(job.stop_set)), banned, session.min_new_tokens)
        try:
            job.step = compose(self._inner(job), session.steerers)
        except Exception as error:  # a steerer failing in wrap is blamed like one failing in its step
            raise self._blame(job, error) from error
        self.jobs.append(job)
        return job

    def _shareable(self, session: "GenerationSession") -> bool:
        """Whether the reply's rows can run in the shared batch: score steerers only, on a
        model whose caches can be stacked (checked once, on a one-token pass)."""
        if not all(type(steerer).shares_batch for steerer in session.steerers):
            return False
        if self._can_merge is None:
            self._can_merge = _MERGEABLE.get(self.model)
        if self._can_merge is None:
            import torch

            ids = torch.tensor([[self.loaded.eos_token_id]], device=self.device)
            with torch.inference_mode():
                output = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
            self._can_merge = _MERGEABLE[self.model] = plain_cache(output_cache(output))
        return self._can_merge

    def _inner(self, job: Job) -> Step:
        """The step a job's steerers wrap: the model on the job's own cache (eager jobs, and a
        shared job's prompt), or the job's rows of the shared pass."""
        model, prompt = self._model_step, self._prompt_step

        def shared_rows(state: StepState) -> StepOutput:
            if job.shared_logits is not None:
                return StepOutput(logits=job.shared_logits, cache=None)
            # The prompt step: every row holds the same prompt, so it runs once, for the first row.
            output = prompt(
                state.replace(
                    input_ids=state.input_ids[:1],
                    attention_mask=state.attention_mask[:1],
                    position_ids=state.position_ids[:1],
                    cache=job.cache,
                )
            )
            job.cache = output.cache
            logits = output.logits.expand(job.rows, -1)
            hidden = None
            if output.hidden_states is not None:
                hidden = tuple(h.expand(job.rows, -1, -1) for h in output.hidden_states)
            return StepOutput(logits=logits, cache=None, hidden_states=hidden)

        return shared_rows if job.shared else model

    # -- stepping ----------------------------------------------------------------------
    def step(self) -> None:
        """Advance every job by one step (a long shared prompt: by one chunk of it)."""
        import torch

        self.drop_cancelled()
        self._take_eager(wait=False)
        ahead, self._ahead = self._ahead, None
        if self.batch.jobs:
            try:
                if ahead is not None:
                    logits = ahead.rows_of(self.batch.jobs)
                else:
                    with torch.inference_mode():
                        logits = self.batch.forward()
                    self.steps += 1
            except Exception as error:
                self._fail(self.batch.jobs, error)
            else:
                offset = 0
                for job in self.batch.jobs:
                    job.shared_logits = logits[offset : offset + job.rows]
                    offset += job.rows
        self._prefill_together()
        chosen = self._choose_plain()
        try:
            read = TokenRead(torch.cat(list(chosen.values()))) if chosen else None
            self._run_ahead(chosen)
            host = self._on_host(chosen, read)
        except Exception as error:  # the device failed: every reply waiting on it ends with the error
            self._fail(chosen, error)
            chosen, host = {}, {}
        beside = any(job.shared for job in self.jobs)  # a batch that must not wait for eager steps
        while self._eager and not beside:  # no batch: eager steps run here again, one at a time
            self._take_eager(wait=True)
        for job in list(self.jobs):
            if job not in self.jobs or job in self._eager:  # ended with the shared pass; its step under way
                continue
            try:
                if job in chosen:
                    self._take(job, chosen[job], host[job])
                elif beside and job.beside and not job.shared:
                    self._start_eager(job)
                else:
                    self._advance(job)
            except Exception as error:
                self._end(job, "error", self._blame(job, error))
        if self._eager and not any(job.shared for job in self.jobs):
            self._take_eager(wait=True)  # nothing else to run: wait for a step under way

    def _fail(self, jobs: Iterable[Job], error: Exception) -> None:
        """End ``jobs`` with the error of a pass they all depended on."""
        failure = ChatcoreError(f"the model failed while generating: {type(error).__name__}: {error}")
        for job in list(jobs):
            self._end(job, "error", failure)

    def _choose_plain(self) -> dict[Job, "torch.Tensor"]:
        """The tokens of every reply whose scores are its rows of a shared pass and that has no
        steerer, chosen before any is recorded, so one copy brings them all to the host."""
        import torch

        chosen: dict[Job, torch.Tensor] = {}
        lanes: dict[tuple[Any, ...], list[Job]] = {}
        for job in list(self.jobs):
            if job in self._deferred or job.shared_logits is None or job.session.steerers:
                continue
            if job.lane is not None and job.shared_logits.shape[-1] == job.width:
                lanes.setdefault((*job.lane, job.generated < job.session.min_new_tokens), []).append(job)
                continue
            self._choose_one(job, chosen)
        for jobs in lanes.values():
            if len(jobs) == 1:
                self._choose_one(jobs[0], chosen)
                continue
            # Replies alike in all that shapes their scores: one restriction and one pass of their
            # processors for their rows stacked, as each would get alone (those processors treat
            # each row alone); then each reply's select draws from its own generator, or, for a
            # decoder whose rows are chosen alone (greedy), one select for all.
            first = jobs[0]
            try:
                with torch.inference_mode():
                    scores = self._processed(first, torch.cat([job.shared_logits for job in jobs]))  # type: ignore[misc]
                    if type(first.decoder).selects_rows_alone:
                        tokens = checked_ids(first.decoder.select(scores, first.session.generator), len(jobs))
                        picked = [tokens[index : index + 1] for index in range(len(jobs))]
                    else:
                        picked = [
                            job.decoder.select(scores[index : index + 1], job.session.generator)
                            for index, job in enumerate(jobs)
                        ]
            except Exception:  # one of them is at fault: each is chosen alone, and blamed alone
                for job in jobs:
                    self._choose_one(job, chosen)
                continue
            chosen.update(zip(jobs, picked))
        return chosen

    def _choose_one(self, job: Job, chosen: dict[Job, "torch.Tensor"]) -> None:
        """Choose one job's tokens from its rows of a shared pass (a failure ends it)."""
        import torch

        assert job.shared_logits is not None
        try:
            with torch.inference_mode():
                chosen[job] = self._choose(job, job.shared_logits)
        except Exception as error:
            self._end(job, "error", self._blame(job, error))

    def _run_ahead(self, chosen: dict[Job, "torch.Tensor"]) -> None:
        """Queue the shared batch's next pass on this step's ``chosen`` tokens before they are
        read (chatcore.serving.ahead), where the batch takes the fast path and this step
        changes nothing but the tokens: every reply is one plain row of the batch (none
        joins, none waits for a prompt or an eager step) and one at least has tokens left."""
        import torch

        batch = self.batch
        if not (self.run_ahead and batch.static_step is not None and batch.jobs and not self._eager):
            return
        if len(self.jobs) != len(batch.jobs) or self._deferred:
            return
        if not all(job.rows == 1 and job in chosen and marked_from_scores(job.decoder) for job in batch.jobs):
            return  # (a decoder that may choose any id has its tokens read and checked first)
        if all(job.generated + 1 >= job.session.max_new_tokens for job in batch.jobs):
            return
        try:
            with torch.inference_mode():
                tokens = torch.cat([chosen[job] for job in batch.jobs])[:, None]
                self._ahead = Ahead(list(batch.jobs), batch.forward(tokens))
        except Exception:  # run again at the next step, where its failure ends the replies
            self._ahead = None
            return
        self.steps += 1
        self.ahead_steps += 1

    @staticmethod
    def _on_host(chosen: dict[Job, "torch.Tensor"], read: TokenRead | None) -> dict[Job, list[int]]:
        """The chosen tokens as Python ints, by job (``read``: all of them, on their way to the
        host): one wait for the device in all."""
        if read is None:  # nothing chosen
            return {}
        values = read.values()
        host, start = {}, 0
        for job, tokens in chosen.items():
            host[job] = values[start : start + tokens.shape[0]]
            start += tokens.shape[0]
        return host

    def _take(self, job: Job, tokens: "torch.Tensor", host: list[int] | None = None) -> None:
        """Record a shared reply's chosen tokens; after its prompt step, it joins the batch."""
        job.shared_logits = None
        if job.generated == 0:
            job.cached = job.prompt_length
            self._keep_prompt(job)
        self._record(job, tokens, host)
        if job.generated == 1 and job in self.jobs:  # still writing: it joins the batch
            self.batch.join(job, job.cache)
            job.cache = None

    def _start_eager(self, job: Job) -> None:
        """Run the eager job's next step on the worker thread (see :meth:`_take_eager`)."""

        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chatcore-eager")
        self._eager[job] = self._worker.submit(self._stepped, job, self._state(job))

    def _take_eager(self, wait: bool) -> None:
        """Record the tokens of the eager steps that are done (with ``wait``, once one is).
        A job that ended meanwhile (cancelled) has its step's result dropped."""
        if not self._eager:
            return
        if wait:
            concurrent.futures.wait(list(self._eager.values()), return_when=concurrent.futures.FIRST_COMPLETED)
        for job, future in list(self._eager.items()):
            if not future.done():
                continue
            del self._eager[job]
            if job not in self.jobs:
                continue
            try:
                self._apply(job, *future.result())
            except Exception as error:
                self._end(job, "error", self._blame(job, error))

    def drop_cancelled(self) -> None:
        for job in [job for job in self.jobs if job.sink.cancelled]:
            self._end(job, "cancelled")

    def cancel_all(self, reason: Any = "cancelled", error: ChatcoreError | None = None) -> None:
        for job in list(self.jobs):
            self._end(job, reason, error)

    def _blame(self, job: Job, error: Exception) -> ChatcoreError:
        """The reply's one-line error. chatcore's own errors stand as they are, but for one a
        steerer's code raised (or a chatcore function it called): that is the steerer's failure,
        named as one; an OptionError stays the request's (a setting that does not fit)."""
        layer = failed_layer(error) or ""
        if isinstance(error, ChatcoreError) and (
            isinstance(error, (OptionError, PluginError)) or not layer.startswith("steerer:")
        ):
            return error
        failure = self.faults.blame(error, job.decoder)
        failure.__cause__ = error
        return failure

    def _advance(self, job: Job) -> None:

        if job in self._deferred:  # its prompt runs next step, after the one it shares a history with
            return
        if job.generated == 0 and job.shared and job.shared_logits is None:
            if job.cache is None and self.prefix_cache is not None:
                self._reuse_prefix(job)
            if self._prefill_chunk(job):
                return
        self._apply(job, *self._stepped(job, self._state(job)))

    def _stepped(self, job: Job, state: StepState) -> tuple[StepOutput, "torch.Tensor"]:
        """The job's composed step on ``state`` and the tokens chosen from it (on whichever
        thread runs it: see :meth:`_start_eager`)."""
        import torch

        # Shared jobs run in inference mode like the batch; an eager job's steerers may take
        # gradients (PPLM), so its tensors must be ordinary ones.
        with torch.inference_mode() if job.shared else torch.no_grad():
            output = job.step(state)
            return output, self._choose(job, output.logits)

    def _apply(self, job: Job, output: StepOutput, tokens: "torch.Tensor") -> None:
        """Record the tokens of the job's own step: a shared job's as :meth:`_take` does, an
        eager job's with the cache its step returned."""
        if job.shared:
            self._take(job, tokens)
        else:
            job.cache = output.cache
            self._record(job, tokens)

    def _prefill_together(self) -> None:
        """Run the prompts of the shared replies that start now in one packed forward pass.

        Each reply with no steerer whose prompt (what is left of it after the prefix cache and
        its chunks) fits a chunk is ready; with two or more ready, their new tokens run as one
        sequence whose mask lets each token see only its own prompt (:func:`packed_prompts`),
        instead of one pass per prompt. A ready prompt that shares a longer run with an earlier
        one of the group than with the prefix cache waits a step, to reuse that one's keys
        (once: where the cache keeps nothing, or did not keep that run, it is read at once)."""
        if self.prefix_cache is not None:  # before the lengths are compared: a hit may leave a short rest
            for job in self._ready_to_prefill(any_length=True):
                if job.cache is None and "prefix_cached_tokens" not in job.provenance:
                    self._reuse_prefix(job)
        self._deferred.clear()
        group: list[Job] = []
        budget = None if self.prefill_chunk is None else 4 * self.prefill_chunk
        for job in self._ready_to_prefill():
            prompt = job.session.prompt_ids
            reused = job.provenance.get("prefix_cached_tokens", 0)
            if (
                self.prefix_cache is not None
                and self.prefix_cache.budget > 0  # else nothing is stored to wait for
                and not job.waited  # at most once: the run may not have been kept (too large, evicted)
                and job.prefilled == reused  # no chunk of its own read yet
                and any(
                    common_length(prompt, other.session.prompt_ids) >= reused + self.prefix_cache.min_tokens
                    for other in group
                )
            ):
                # Another prompt of the group holds more of it than the cache (a shared history
                # beyond a cached system prompt): looked up again next step, once that one is stored.
                job.provenance.pop("prefix_cached_tokens", None)
                job.cache, job.prefilled = None, 0
                job.waited = True
                self._deferred.add(job)
                continue
            new = len(prompt) - job.prefilled
            if budget is not None and group and new > budget:
                continue
            group.append(job)
            if budget is not None:
                budget -= new
        if len(group) < 2:
            return
        try:
            logits, caches = packed_prompts(self.model, self.batch.cache_argument, group)
        except Exception as error:
            failure = ChatcoreError(f"the model failed while reading the prompt: {type(error).__name__}: {error}")
            for job in group:
                self._end(job, "error", failure)
            return
        self.packed_prefills += 1
        for index, job in enumerate(group):
            job.shared_logits = logits[index : index + 1].expand(job.rows, -1)
            job.cache = caches[index]

    def _ready_to_prefill(self, any_length: bool = False) -> list[Job]:
        """Shared replies with no steerer whose prompt step comes next (see _prefill_together);
        ``any_length``: also those whose prompt has more than a chunk left."""
        chunk = None if any_length else self.prefill_chunk
        return [
            job
            for job in self.jobs
            if job.shared
            and job.generated == 0
            and job.shared_logits is None
            and not job.session.steerers
            and not job.sink.cancelled
            and (chunk is None or len(job.session.prompt_ids) - job.prefilled <= chunk)
        ]

    def _reuse_prefix(self, job: Job) -> None:
        """Start a shared job's prompt after the longest prefix of it the prefix cache holds.

        Looked up when the prompt is about to run, not when the job was added, so that
        replies admitted together that share a history (a system prompt, a persona, the
        same conversation) reuse the first one's prompt as soon as it has run."""
        assert self.prefix_cache is not None
        reused, layers = self.prefix_cache.lookup(job.session.prompt_ids, leave=self.prompt_rest)
        job.provenance["prefix_cached_tokens"] = reused
        if layers is not None:
            job.prefilled = reused
            job.cache = cache_holding(layers, self.model.config)

    def _keep_prompt(self, job: Job) -> None:
        """Store a shared job's prompt in the prefix cache once it has run (see _reuse_prefix)."""
        if self.prefix_cache is None or job.cache is None:
            return
        layers = [(layer.keys[:1], layer.values[:1]) for layer in job.cache.layers]
        self.prefix_cache.store(list(job.session.prompt_ids), layers)  # the host's copy: no wait

    def _prefill_chunk(self, job: Job) -> bool:
        """Run one more chunk of a shared job's long prompt, alone and without steerers (its
        scores are not used); False once what is left fits the prompt step."""
        import torch

        prompt = job.session.prompt_ids
        if self.prefill_chunk is None or len(prompt) - job.prefilled <= self.prefill_chunk:
            return False
        end = min(job.prefilled + self.prefill_chunk, len(prompt) - self.prompt_rest)
        ids = job.sequences[:1, :end]
        try:
            with torch.inference_mode():
                output = self.model(
                    input_ids=ids[:, job.prefilled :],
                    attention_mask=torch.ones_like(ids),
                    position_ids=torch.arange(job.prefilled, end, device=self.device)[None],
                    **{self.batch.cache_argument: job.cache},
                    use_cache=True,
                    logits_to_keep=1,
                )
        except Exception as error:
            raise ChatcoreError(
                f"the model failed while reading the prompt: {type(error).__name__}: {error}"
            ) from error
        job.cache = output_cache(output)
        job.prefilled = end
        return True

    def _state(self, job: Job) -> StepState:
        """What the job's step sees now (see StepState)."""
        import torch

        sequences = job.sequences[:, : job.length]
        attention = job.attention[:, : job.length]
        rows = tuple(range(job.rows))
        if job.generated == 0:
            start = job.prefilled
            positions = torch.arange(start, job.length, device=self.device).expand(job.rows, -1)
            return StepState(
                input_ids=sequences[:, start:],
                sequences=sequences,
                attention_mask=attention,
                position_ids=positions,
                cache=job.cache if job.shared else None,
                step=0,
                prompt_length=job.prompt_length,
                rows=rows,
            )
        # Every row counts every column (ended rows are fed EOS, masked), as in one sequence.
        positions = torch.full((job.rows, 1), job.length - 1, dtype=torch.long, device=self.device)
        return StepState(
            input_ids=sequences[:, -1:],
            sequences=sequences,
            attention_mask=attention,
            position_ids=positions,
            cache=None if job.shared else job.cache,
            step=job.generated,
            prompt_length=job.prompt_length,
            rows=rows,
        )

    def _choose(self, job: Job, logits: "torch.Tensor") -> "torch.Tensor":
        """Each row's next token from the job's (rows, V) steered scores."""
        import torch

        session = job.session
        scores = self._processed(job, logits)
        try:
            tokens = checked_ids(job.decoder.select(scores, session.generator), job.rows)
            if session.steerers or not marked_from_scores(job.decoder):
                # Scores a plugin made may reach a select that does not fail on them (an argmax
                # picks a NaN, or index 0 of a row of -inf): a row whose best score is not finite
                # has a NaN or no finite score. (Read here, where these replies' tokens are read
                # at once anyway.) A decoder may still choose a banned token of a sound row.
                sound = torch.isfinite(scores.amax(dim=-1))
                if job.rows > 1:
                    sound |= job.finished
                if not bool(sound.all()):
                    raise ValueError("select was given scores with NaN or a row of no finite score")
        except Exception as error:  # scores a steerer left unusable are the steerer's fault
            layer = scores_spoiled_by(job.step, logits) if session.steerers else None
            if layer is None:
                raise
            spoiled = ValueError(
                f"its step left scores with NaN or a row of no finite score ({type(error).__name__}: {error})"
            )
            setattr(spoiled, LAYER_ATTRIBUTE, layer)
            raise spoiled from error
        if job.rows > 1:  # a one-row reply ends at its stop token, so it is never fed one
            tokens = torch.where(job.finished, torch.full_like(tokens, self.loaded.eos_token_id), tokens)
        if job.logprobs is not None and session.logprobs is not None:
            job.logprobs.append(chosen_logprobs(scores, tokens, session.logprobs))
        if job.totals is not None and job.counts is not None:
            # The forward score: log-probabilities of the steered scores, before the decoder's filters.
            picked = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
            job.totals += torch.where(job.finished, torch.zeros_like(picked), picked).double()
            job.counts += (~job.finished).long()
        return tokens

    @staticmethod
    def _processed(job: Job, logits: "torch.Tensor") -> "torch.Tensor":
        """The job's (rows, V) steered scores (or rows of alike jobs stacked) restricted and
        through the job's processors: what its decoder selects from."""
        session = job.session
        if logits.shape[-1] != job.width:  # a model whose scores are not its output layer's rows
            job.width = logits.shape[-1]
            job.stops = within(session.stop_ids, job.width, logits.device)
            job.banned = within(session.banned_token_ids, job.width, logits.device)
        scores = restrict_scores(logits, job.banned, job.stops, early=job.generated < session.min_new_tokens)
        return job.processors(job.sequences[:, : job.length], scores)

    def _record(self, job: Job, tokens: "torch.Tensor", host: list[int] | None = None) -> None:
        """Append the chosen tokens (``host``: the same as ints, when already read); stream, or
        end the job when its rows are done."""
        import torch

        if job.rows == 1:
            token = host[0] if host is not None else int(tokens[0])
            if not 0 <= token < job.width:
                raise ValueError(f"select chose token id {token}, outside the scores' 0 to {job.width - 1}")
        else:  # these rows are read every step already (the rows that have ended)
            low, high = (int(value) for value in torch.aminmax(tokens))
            if low < 0 or high >= job.width:
                raise ValueError(f"select chose token id {low if low < 0 else high}, outside 0 to {job.width - 1}")
        if not job.host_tokens:
            job.sequences[:, job.length] = tokens
        job.length += 1
        job.generated += 1
        if job.observer is not None:
            job.observer(tokens)
        budget_spent = job.generated >= job.session.max_new_tokens
        if job.rows == 1:  # no row has stopped before (it would have ended): its attention is all 1
            job.chosen.append(token)
            if token in job.stop_set:
                self._end(job, "stop")
                return
            job.sink._push(token, job.logprobs[-1][0] if job.logprobs else None)
            if budget_spent:
                self._end(job, "length")
            return
        job.attention[:, job.length - 1] = (~job.finished).long()
        job.finished |= torch.isin(tokens, job.stops)
        assert job.counts is not None and job.totals is not None
        ended = job.finished.tolist()
        if not (all(ended) or budget_spent or job.decoder.enough(ended, job.counts.tolist())):
            return
        stops = set(job.stops.tolist())
        sampled = []
        for row, done in enumerate(ended):
            written = job.sequences[row, job.prompt_length : job.length].tolist()
            cut = next((i for i, token in enumerate(written) if token in stops), len(written))
            sampled.append(Sampled(written[:cut], float(job.totals[row]), int(job.counts[row]), done))
        decoder = job.decoder
        winner = self.faults.guard(decoder, "choose", lambda: decoder.choose(job.session, sampled))
        for index, token in enumerate(sampled[winner].token_ids):
            job.sink._push(token, job.logprobs[index][winner] if job.logprobs else None)
        self._end(job, "stop" if sampled[winner].ended else "length")

    def _end(self, job: Job, reason: Any, error: ChatcoreError | None = None) -> None:
        """The job is over: note its provenance, keep its prefix, leave the batch, tell the sink."""
        import dataclasses

        if job not in self.jobs:
            return
        self.jobs.remove(job)
        session = job.session
        if session.candidates:
            job.provenance["candidates"] = [dataclasses.asdict(c) for c in session.candidates]
        if session.details:
            job.provenance["details"] = session.details
        if reason in ("stop", "length") and job.shared and job.rows == 1 and self.prefix_cache is not None:
            # What the row fed the model is the start of its conversation's next prompt.
            try:
                if job in self.batch:
                    layers = self.batch.layers_of(job)
                else:
                    layers = [(layer.keys[:1], layer.values[:1]) for layer in job.cache.layers]
                tokens = [*job.session.prompt_ids, *job.chosen][: job.cached]  # the host's copy: no wait
                self.prefix_cache.store(tokens, layers)
            except Exception:  # a cache that cannot be kept costs the next turn a prefill, nothing more
                pass
        try:
            self.batch.leave(job)
        finally:  # whatever happens, the caller learns that the reply is over
            job.cache = job.shared_logits = None
            job.sink._end(reason, error)


def checked_ids(tokens: Any, rows: int) -> "torch.Tensor":
    """A decoder's ``select`` output, checked for what can be seen without reading it: a
    (rows,) tensor of integer ids (their range is checked where they are read)."""
    import torch

    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"select returned {type(tokens).__name__}: a ({rows},) tensor of token ids is needed")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"select returned {tokens.dtype} values: token ids are integers")
    if tuple(tokens.shape) != (rows,):
        raise ValueError(f"select returned shape {tuple(tokens.shape)} for {rows} row(s): ({rows},) is needed")
    return tokens


def scores_width(model: Any) -> int:
    """How many scores the model gives per position: its output layer's rows (or, for a
    model without one, its configured vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


def decode_alone(
    model: "LoadedModel", faults: Faults, session: "GenerationSession", decoder: "Decoder", provenance: dict[str, Any]
) -> Iterator[int]:
    """Decode one reply (its started ``session``, ``decoder`` and ``provenance``) on the
    caller's thread, as a runner of its own: its token ids as they come (a failure raises
    its one-line ChatcoreError, as ``faults`` words it; closing the iterator stops it)."""
    from chatcore.serving.requests import Handle

    handle = Handle()
    handle.provenance = provenance
    handle.admitted = handle.submitted  # no queue: it starts at once
    runner = Runner(model, faults, prefill_chunk=None)  # nothing else waits for it
    runner.add(handle, session, decoder, provenance)
    sent = 0
    try:
        while runner.jobs:
            runner.step()
            while sent < len(handle.token_ids):
                sent += 1
                yield handle.token_ids[sent - 1]
    finally:
        runner.cancel_all()
    if handle.error is not None:
        raise handle.error
