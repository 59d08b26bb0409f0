"""``chatcore models``: the models chatcore can name, where they are and what they take on disk;
``chatcore models rm`` removes a converted GGUF folder.

Nothing here imports torch: listing reads folders, file sizes and small JSON files, and the
GGUF content hash (remembered per path after its first read).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from chatcore.errors import OptionError

if TYPE_CHECKING:
    from chatcore.gguf_packed import PackShift


@dataclass
class ConvertedFolder:
    folder: Path
    size: int
    source: str  # the GGUF file's name, or "?" for a folder of an older layout
    dtype: str
    current: bool  # made by this version's conversion (older layouts are never loaded again)


def folder_size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())


def human_size(size: int) -> str:
    """Binary units, as ``du -h`` counts them."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def converted_folders() -> list[ConvertedFolder]:
    """Every converted model under the cache root, finished ones only (staging folders are skipped)."""
    from chatcore.gguf import COMPLETE_MARKER, CONVERSION_VERSION, SOURCE_FILE, cache_root

    root = cache_root()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not (folder / COMPLETE_MARKER).is_file():
            continue
        try:
            source = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            source = {}
        if not isinstance(source, dict):
            source = {}
        found.append(
            ConvertedFolder(
                folder=folder,
                size=folder_size(folder),
                source=str(source.get("file", "?")),
                dtype=str(source.get("dtype", "float32")),
                current=source.get("version") == CONVERSION_VERSION,
            )
        )
    return found


def converted_of(gguf_file: Path) -> Path | None:
    """The finished conversion of a GGUF file, if there is one."""
    from chatcore.gguf import COMPLETE_MARKER, cached_folder

    folder = cached_folder(gguf_file)
    return folder if (folder / COMPLETE_MARKER).is_file() else None


@click.group("models", invoke_without_command=True)
@click.pass_context
def models(context: click.Context) -> None:
    """List the bundled, known and converted models with their sizes and paths.

    A GGUF file (`--model FILE.gguf`, or a known name such as smollm2) is converted once into
    a folder under the cache; `chatcore models rm` removes one.
    """
    if context.invoked_subcommand is not None:
        return
    from chatcore.errors import ModelLoadError
    from chatcore.gguf import cache_root
    from chatcore.models import BUNDLED_DIR, KNOWN_MODELS, bundled_models, known_model_file

    click.echo("bundled (inside the package):")
    for name in bundled_models():
        folder = BUNDLED_DIR / name
        click.echo(f"  {name:24s} {human_size(folder_size(folder)):>9s}  {folder}")
    in_use: dict[Path, str] = {}
    click.echo("known (by name, from an installed package's GGUF file):")
    for name, known in KNOWN_MODELS.items():
        try:
            gguf_file = known_model_file(name)
        except ModelLoadError:
            click.echo(f"  {name:24s} {'-':>9s}  not installed: {known.install}")
            continue
        click.echo(f"  {name:24s} {human_size(gguf_file.stat().st_size):>9s}  {gguf_file}")
        converted = converted_of(gguf_file)
        if converted is None:
            click.echo(f"  {'':24s} {'':>9s}  not converted yet (the first use converts it)")
        else:
            in_use[converted] = name
            click.echo(f"  {'':24s} {human_size(folder_size(converted)):>9s}  converted: {converted}")
    folders = converted_folders()
    click.echo(f"converted GGUF folders ({cache_root()}):")
    if not folders:
        click.echo("  none")
    width = max([40, *(len(entry.folder.name) for entry in folders)])
    for entry in folders:
        notes = [entry.dtype, f"from {entry.source}"]
        if entry.folder in in_use:
            notes.append(f"= {in_use[entry.folder]}")
        if not entry.current:
            notes.append("an older chatcore's layout, which this version does not load")
        click.echo(f"  {entry.folder.name:{width}s} {human_size(entry.size):>9s}  {', '.join(notes)}")
    if folders:
        click.echo(f"  {'total':{width}s} {human_size(sum(entry.size for entry in folders)):>9s}")


def resolve_removal(target: str) -> list[Path]:
    """The converted folders ``target`` names: a folder's name or path under the cache, a GGUF
    file, a known model's name, or ``all``. Anything outside the cache is refused."""
    from chatcore.gguf import cache_root, is_gguf_path
    from chatcore.models import KNOWN_MODELS, known_model_file

    root = cache_root().resolve()
    if target == "all":
        return [entry.folder for entry in converted_folders()] + stale_staging()
    if target in KNOWN_MODELS:
        folder = converted_of(known_model_file(target))
        if folder is None:
            raise OptionError(f"model {target!r} has no converted folder to remove")
        return [folder]
    path = Path(target).expanduser()
    if path.is_file() and is_gguf_path(target):
        folder = converted_of(path)
        if folder is None:
            raise OptionError(f"{target!r} has no converted folder to remove")
        return [folder]
    candidate = path if path.is_dir() else root / target
    if candidate.is_dir() and candidate.resolve().parent == root:
        return [candidate]
    raise OptionError(
        f"{target!r} is not a converted model (a name listed by `chatcore models`, a GGUF file, "
        f"a known model's name or all); only folders under {root} are removed"
    )


def stale_staging() -> list[Path]:
    from chatcore.gguf import cache_root

    root = cache_root()
    return sorted(path for path in root.glob(".*") if path.is_dir()) if root.is_dir() else []


@models.command("rm")
@click.argument("target")
@click.option("-y", "--yes", is_flag=True, help="Remove without asking.")
def remove(target: str, yes: bool) -> None:
    """Remove a converted model folder: NAME (as `chatcore models` lists it), its PATH, the GGUF
    file it came from, a known model's name (smollm2), or all. The GGUF file itself is kept,
    and the next use converts it again."""
    folders = resolve_removal(target)
    if not folders:
        click.echo("nothing to remove")
        return
    total = sum(folder_size(folder) for folder in folders)
    for folder in folders:
        click.echo(f"{folder}  {human_size(folder_size(folder))}")
    if not yes:
        click.confirm(f"remove {len(folders)} folder(s), {human_size(total)}?", abort=True)
    for folder in folders:
        shutil.rmtree(folder)
    click.echo(f"removed {len(folders)} folder(s), {human_size(total)}")


# Files of a model folder that hold its weights; everything else (config, tokenizer, training
# record) is copied into a packed folder as it is.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


ALREADY_PACKED = (
    "already keeps its weights in quantized blocks (a packed folder or a converted GGUF "
    "file): packing it again would only add size or error"
)


@models.command("pack")
@click.argument("model")
@click.option("--out", "out_text", required=True, type=click.Path(), help="The new folder (must not exist).")
def pack(model: str, out_text: str) -> None:
    """Store a model folder's weight matrices in 8 bits (GGUF's Q8_0 blocks): about half the size
    of float16. MODEL is a model folder or a bundled model's name. The packed folder loads like any
    other (`--model OUT`); the command shows how far packing moved the model's scores."""
    from chatcore.gguf import is_gguf_path
    from chatcore.models import KNOWN_MODELS, resolve_model_path

    if not out_text.strip():
        raise OptionError("--out is empty; name a new folder")
    out = Path(out_text)
    if out.exists():
        raise OptionError(f"--out {str(out)!r} already exists; name a new folder")
    if model in KNOWN_MODELS or (is_gguf_path(model) and Path(model).expanduser().is_file()):
        # Refused before the GGUF file is converted: its converted folder is packed already.
        raise OptionError(f"{model!r} {ALREADY_PACKED}")
    source = Path(resolve_model_path(model))
    if not source.is_dir():
        raise OptionError(
            f"{model!r} is not a local model folder: pack a downloaded copy "
            "(`hf download ID --local-dir DIR`, then `chatcore models pack DIR`)"
        )
    from chatcore.gguf_packed import is_packed_folder, load_packed_model, pack_model_folder, packing_shift
    from chatcore.models import load_model, quiet_loading

    if is_packed_folder(source):
        raise OptionError(f"{model!r} {ALREADY_PACKED}")
    staging = out.with_name(f".{out.name}.packing")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as error:
        raise OptionError(f"cannot create --out {str(out)!r}: {error.strerror or error}") from None
    try:
        loaded = load_model(str(source), device="cpu", dtype="float32")
        for file in source.iterdir():
            if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(file, staging / file.name)
        counts = pack_model_folder(loaded.model, staging)
        with quiet_loading():
            packed = load_packed_model(staging, "float32")
        shift = packing_shift(loaded.model, packed, loaded.tokenizer)
        note_packing(staging, source, shift)
        staging.rename(out)
    except OSError as error:  # a full disk, a folder that went away
        shutil.rmtree(staging, ignore_errors=True)
        raise OptionError(f"cannot write --out {str(out)!r}: {error.strerror or error}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    storage = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
    click.echo(f"packed {source} ({human_size(folder_size(source))}) into {out} ({human_size(folder_size(out))})")
    click.echo(f"tensors: {storage}")
    click.echo(
        f"sample text, {shift.tokens} tokens: "
        f"perplexity {shift.perplexity_before:.2f} -> {shift.perplexity_after:.2f}; "
        f"next-token log-probability moved {shift.mean_shift:.4f} nats on average, {shift.largest_shift:.4f} at most"
    )


def note_packing(folder: Path, source: Path, shift: PackShift) -> None:
    """Add the packing to the folder's training record, where it has one."""
    from dataclasses import asdict

    record_file = folder / "chatcore_training.json"
    if not record_file.is_file():
        return
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(record, dict):
        record["packed"] = {"blocks": "Q8_0", "from": source.name, "sample_text": asdict(shift)}
        record_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
