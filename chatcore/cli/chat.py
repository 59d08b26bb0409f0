"""``chatcore chat``: talk to the model in the terminal (a plain line-based loop)."""

from __future__ import annotations

import click

from chatcore.cli.specs import parse_spec

HELP = """commands: /new (new conversation), /decoder SPEC, /steer SPEC, /steer off, /seed N, /quit
SPEC is a name and settings, e.g. /decoder top-k top_k=20   /steer bow-bias topic=food strength=4"""


@click.command()
@click.option("-m", "--model", default="chatcore-tiny", show_default=True, help="Bundled name, local folder or hub id.")
@click.option("-d", "--decoder", "decoder_spec", default="top-k", show_default=True)
@click.option("-s", "--steer", "steer_specs", multiple=True, help="Steerer and settings; repeatable.")
@click.option("--seed", type=int, default=None)
@click.option("-n", "--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--device", default=None)
def chat(model: str, decoder_spec: str, steer_specs: tuple[str, ...], seed: int | None, max_new_tokens: int,
         device: str | None) -> None:
    """Talk with a model in the terminal. Ctrl-C stops a reply; Ctrl-D or /quit exits."""
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.errors import ChatcoreError

    decoder, decoder_settings = parse_spec(decoder_spec)
    options = ReplyOptions(decoder=decoder, decoder_settings=decoder_settings,
                           steerers=[parse_spec(spec) for spec in steer_specs], seed=seed,
                           max_new_tokens=max_new_tokens)
    click.echo(f"loading {model} ...", err=True)
    engine = Engine(model, device=device)
    conversation = engine.conversation()
    click.echo(f"chatcore: {model}, decoder {decoder}. Type /help for commands.", err=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            continue
        stripped = line.strip()
        if not stripped:
            continue
        try:
            if stripped.startswith("/"):
                command, _, rest = stripped.partition(" ")
                if command in ("/quit", "/exit"):
                    return
                if command == "/help":
                    click.echo(HELP)
                elif command == "/new":
                    conversation = engine.conversation()
                    click.echo("(new conversation)")
                elif command == "/decoder":
                    name, settings = parse_spec(rest)
                    engine.make_decoder(name, settings)
                    options.decoder, options.decoder_settings = name, settings
                elif command == "/steer":
                    if rest.strip() == "off":
                        options.steerers = []
                    else:
                        name, settings = parse_spec(rest)
                        engine.make_steerer(name, settings)
                        options.steerers = [s for s in options.steerers if s[0] != name] + [(name, settings)]
                elif command == "/seed":
                    options.seed = int(rest)
                else:
                    click.echo(f"unknown command {command!r}; /help lists them")
                continue
            response = conversation.send(stripped, options)
            click.echo("bot> ", nl=False)
            try:
                for delta in response:
                    click.echo(delta, nl=False)
            except KeyboardInterrupt:
                response.interrupt()
                click.echo(" [interrupted]", nl=False)
            click.echo()
        except (ChatcoreError, ValueError) as error:
            click.echo(f"error: {error}")
