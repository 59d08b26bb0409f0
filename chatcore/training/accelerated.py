"""Hugging Face Accelerate under chatcore's training loops: the run's Accelerator (device,
torchrun processes, mixed precision, gradient accumulation) and its checkpoint folder.

A checkpoint is ``OUT/checkpoint/``, written by ``Accelerator.save_state``: the trained
modules' weights (``model.safetensors``, ``model_1.safetensors``, ...), the optimizers
(``optimizer.bin``, ...), the learning-rate schedulers (``scheduler.bin``, ...), the fp16
GradScaler (``scaler.pt``), each process's random state (Python, NumPy, torch CPU and
CUDA: ``random_states_<rank>.pkl``) and the loop's own counters
(``custom_checkpoint_0.pkl``, see :class:`Progress`). Weights are saved without the
DistributedDataParallel wrapper, so a checkpoint resumes on any number of processes.

A checkpoint is written whole or not at all: into ``checkpoint.partial/``, which then takes
the place of ``checkpoint/`` by renaming (the previous one, briefly ``checkpoint.previous/``,
is removed only once the new one is in place). A run stopped at any moment, even by
SIGKILL, leaves its last whole checkpoint; :func:`checkpoint_to_resume` puts a
``checkpoint.previous/`` left by a stop between the two renames back in place.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from accelerate import Accelerator, PartialState

CHECKPOINT_DIR = "checkpoint"
PROGRESS_FILE = "custom_checkpoint_0.pkl"  # Accelerate's name for the first registered object
OLD_CHECKPOINT_FILE = "checkpoint.pt"  # the single-file format before Accelerate
PARTIAL_SUFFIX = ".partial"  # a folder being written
PREVIOUS_SUFFIX = ".previous"  # the folder it replaces, while the two swap places


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands in a torchrun launch (rank 0 of 1 when run plainly)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def distributed_context() -> DistributedContext:
    """Read the rank and world size that torchrun (or any env:// launcher) exports."""
    try:
        return DistributedContext(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    except ValueError as error:
        raise ChatcoreError(f"bad RANK / LOCAL_RANK / WORLD_SIZE in the environment: {error}") from None


def _on_cpu(device: str | None) -> bool:
    """Whether ``device`` (None: CUDA when present) keeps the run off the GPU."""
    import torch

    return device == "cpu" or (device is None and not torch.cuda.is_available())


def process_state(device: str | None) -> "PartialState":
    """This process's place in the launch; under torchrun, joining the process group
    (NCCL on GPUs, gloo with ``device='cpu'``). Call it with the run's own device."""
    from accelerate import PartialState

    return PartialState(cpu=_on_cpu(device))


def mixed_precision(precision: str, device: str) -> str:
    """Accelerate's mixed-precision mode for a ``precision`` setting on ``device``
    (``auto``: bf16 on a GPU that has it, else fp32)."""
    import torch

    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "fp32"
    return "no" if precision == "fp32" else precision


def check_precision(precision: str, device: str | None) -> None:
    """Refuse, in one line, a precision the device cannot train in (fp16 on a CPU: torch has
    no loss scaling there). Called before a run loads its corpus, and again by
    :func:`make_accelerator`."""
    from chatcore.models import pick_device

    resolved = ("cpu" if _on_cpu(device) else "cuda") if distributed_context().enabled else pick_device(device)
    if resolved == "cpu" and mixed_precision(precision, resolved) == "fp16":
        raise ChatcoreError("--precision fp16 needs a GPU: on the CPU use bf16 or fp32")


def make_accelerator(device: str | None, precision: str, grad_accum: int = 1) -> "Accelerator":
    """The Accelerator of one training run on ``device`` (None: CUDA when present; under
    torchrun each process takes its local GPU). The optimizer step, scheduler step and
    gradient clipping are the loop's to call, once per optimizer step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from chatcore.models import pick_device

    distributed = distributed_context().enabled
    # Each run sets its own device, precision and accumulation: forget the previous run's
    # in this process (a torchrun launch keeps its process group).
    AcceleratorState._reset_state(reset_partial_state=not distributed)
    GradientState._reset_state()
    if distributed:
        device = "cpu" if _on_cpu(device) else "cuda"
    else:
        device = pick_device(device)
        if device.startswith("cuda:"):
            import torch

            torch.cuda.set_device(int(device.partition(":")[2]))
    check_precision(precision, device)
    try:
        accelerator = Accelerator(
            cpu=device == "cpu",
            mixed_precision=mixed_precision(precision, device),
            gradient_accumulation_steps=grad_accum,
            step_scheduler_with_optimizer=False,
        )
    except ValueError as error:
        raise ChatcoreError(f"cannot train with precision {precision!r} on {device}: {error}") from None

    def unwrapped_weights(models: list[Any], weights: list[Any], output_dir: str) -> None:
        weights[:] = [_untied(accelerator.unwrap_model(model).state_dict()) for model in models]

    def unwrapped_models(models: list[Any], input_dir: str) -> None:
        models[:] = [accelerator.unwrap_model(model) for model in models]

    accelerator.register_save_state_pre_hook(unwrapped_weights)
    accelerator.register_load_state_pre_hook(unwrapped_models)
    return accelerator


def _untied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor once: tied weights (GPT-2's embedding and LM head) share
    one, which safetensors stores once and its loader ties back."""
    from accelerate.utils import id_tensor_storage

    seen: set[Any] = set()
    kept = {}
    for name, tensor in state.items():
        if id_tensor_storage(tensor) not in seen:
            seen.add(id_tensor_storage(tensor))
            kept[name] = tensor
    return kept


class Progress:
    """A loop's own state (step, counters, its data generator, settings), saved and
    restored with Accelerate's: register it with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = dict(state)


def replace_folder(written: Path, target: Path) -> None:
    """Put the complete folder ``written`` in the place of ``target`` (which may not exist):
    ``target`` is renamed aside first and removed only once ``written`` is in place, so at
    every moment one whole folder is on disk under one of the two names."""
    previous = target.with_name(target.name + PREVIOUS_SUFFIX)
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        target.rename(previous)
    written.rename(target)
    if previous.exists():
        shutil.rmtree(previous)


def partial_folder(target: Path) -> Path:
    """An empty sibling of ``target`` to write a new version of it into (then :func:`replace_folder`)."""
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)  # left by a run stopped while it wrote
    return partial


def restore_previous(target: Path) -> None:
    """``target`` back from the ``.previous`` copy that a stop between the two renames of
    :func:`replace_folder` left alone on disk."""
    previous = target.with_name(target.name + PREVIOUS_SUFFIX)
    if not target.exists() and previous.is_dir():
        previous.rename(target)


def checkpoint_to_resume(out_dir: Path) -> Path:
    """The checkpoint folder in ``out_dir`` that ``--resume`` continues from; a missing one,
    or one in the format before Accelerate, is refused in one line."""
    folder = out_dir / CHECKPOINT_DIR
    restore_previous(folder)
    if (folder / PROGRESS_FILE).is_file():
        return folder
    if (out_dir / OLD_CHECKPOINT_FILE).is_file():
        raise ChatcoreError(
            f"--resume: {out_dir / OLD_CHECKPOINT_FILE} is in the format of an older chatcore, which cannot be "
            f"resumed: train again without --resume (or into another --out folder)"
        )
    raise ChatcoreError(f"--resume: no checkpoint in {folder}")


def damaged_checkpoint(folder: Path, error: BaseException) -> ChatcoreError:
    """The one-line error for a checkpoint whose files cannot be read."""
    detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
    detail = detail.split(". ")[0].rstrip(".")[:160]  # torch's reader adds sentences of advice
    return ChatcoreError(
        f"--resume: the checkpoint in {folder} is damaged and cannot be read ({detail}): train again "
        f"into another --out (the run's best/ model, if any, is intact)"
    )


def read_progress(folder: Path) -> dict[str, Any]:
    """The loop's own state saved in checkpoint ``folder`` (without loading the rest); an
    unreadable one is refused in one line."""
    import pickle

    import torch

    try:
        state: dict[str, Any] = torch.load(folder / PROGRESS_FILE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        raise damaged_checkpoint(folder, error) from None
    return state


def save_checkpoint(accelerator: "Accelerator", folder: Path) -> None:
    """Write the run's state into ``folder``, whole (see the module's docstring); every
    process calls it (each writes its own random state) and waits for the others."""
    partial = folder.with_name(folder.name + PARTIAL_SUFFIX)
    if accelerator.is_main_process:
        partial_folder(folder)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        replace_folder(partial, folder)
    accelerator.wait_for_everyone()


# What the model loader says when the checkpoint holds another model: other shapes, or other
# or fewer layers.
SHAPE_ERRORS = ("size mismatch", "Missing key(s)", "Unexpected key(s)")


def load_checkpoint(accelerator: "Accelerator", folder: Path) -> None:
    """Restore the state :func:`save_checkpoint` wrote into the prepared objects; a checkpoint
    of another shape than the run's (other model settings), or one whose files cannot be
    read, is refused in one line."""
    import pickle

    try:
        accelerator.load_state(str(folder))
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        mismatch = next((line for line in lines if any(sign in line for sign in SHAPE_ERRORS)), None)
        if mismatch is None:
            raise damaged_checkpoint(folder, error) from None
        if len(mismatch) > 200:
            mismatch = mismatch[:200] + "..."
        raise ChatcoreError(
            f"--resume: the checkpoint in {folder} was trained with other settings for the model's shape "
            f"({mismatch.rstrip('.')}): give the settings it was started with"
        ) from None
    except (OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as error:
        raise damaged_checkpoint(folder, error) from None
    except Exception as error:
        if type(error).__name__ != "SafetensorError":  # safetensors' own, for a cut weights file
            raise
        raise damaged_checkpoint(folder, error) from None
    # The checkpoint was taken between optimizer steps: accumulation starts afresh (with
    # this run's grad_accum, which may differ from the saved run's).
    accelerator.step = 0
