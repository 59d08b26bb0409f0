"""``chatcore train vector``: a steering vector from two files of contrast texts."""

from __future__ import annotations

from pathlib import Path

import click

from chatcore.api import model_option

from .vectors import BUILTIN_PAIRS


@click.command("vector")
@model_option
@click.option(
    "--positive",
    type=click.Path(dir_okay=False),
    default=None,
    help="Texts to steer towards, one per line.",
)
@click.option(
    "--negative",
    type=click.Path(dir_okay=False),
    default=None,
    help="Texts to steer away from, one per line (ideally each the partner of the same line in --positive).",
)
@click.option(
    "--pairs",
    type=click.Choice(sorted(BUILTIN_PAIRS)),
    default=None,
    help="A built-in contrast set instead of --positive/--negative.",
)
@click.option(
    "--layer",
    type=click.IntRange(0, None),
    default=None,
    help="The block whose output is read (default: a third of the way up).",
)
@click.option(
    "--out",
    "out_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where to write the vector: OUT.safetensors and OUT.json (in a folder that exists).",
)
@click.option("--device", default=None, help="auto, cpu, cuda, cuda:N or mps.")
@click.option("--force", is_flag=True, help="Replace an existing vector at --out.")
def train_vector_command(
    model: str,
    positive: str | None,
    negative: str | None,
    pairs: str | None,
    layer: int | None,
    out_path: str,
    device: str | None,
    force: bool,
) -> None:
    """Make a steering vector: the mean residual activation of the --positive texts minus that of
    the --negative texts after block --layer (contrastive activation addition).

    The model is the one chat and generate load when none is named (--model), so the vector
    fits them. The vector is saved with the model's hash; `--steer "vector path=OUT strength=0.15"`
    refuses it on any other model.
    """
    from chatcore.api import OptionError, load_model, output_file

    from .vectors import build_vector, builtin_pair_files, read_texts, save_vector, vector_files

    if device is not None and not device.strip():  # load_model would take it for auto
        raise OptionError(f"--device must name a device (auto, cpu, cuda, cuda:N or mps), got {device!r}")
    if pairs is not None:
        if positive is not None or negative is not None:
            raise OptionError("give either --pairs or --positive and --negative, not both")
        positive_file, negative_file = (str(path) for path in builtin_pair_files(pairs))
    elif positive is None or negative is None:
        raise OptionError("give --positive FILE and --negative FILE (or --pairs NAME)")
    else:
        positive_file, negative_file = positive, negative
    for written in vector_files(out_path):  # before the model loads and the texts run
        check_vector_folder(written)
        output_file(str(written), replace=force)
    towards, away = read_texts(positive_file), read_texts(negative_file)
    loaded = load_model(model, device=device)
    found = build_vector(
        loaded, towards, away, layer, (positive_file, negative_file), progress=lambda line: click.echo(line, err=True)
    )
    tensors, meta = save_vector(found, out_path)
    info = found.info
    click.echo(
        f"wrote {tensors} and {meta}: layer {info.layer}, norm {info.norm:.4g} "
        f"(residual norm there {info.residual_norm:.4g}), model {info.model_name} hash {info.model_hash}"
    )


def check_vector_folder(path: Path) -> None:
    """Refuse, in one line, a vector file whose folder does not exist (it is not made)."""
    from chatcore.api import OptionError

    folder = path.parent
    if folder.is_dir():
        return
    above = next((parent for parent in path.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise OptionError(f"cannot write --out {str(path)!r}: {str(above)!r} is not a folder")
    raise OptionError(f"cannot write --out {str(path)!r}: the folder {str(folder)!r} does not exist")
