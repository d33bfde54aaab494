"""Entry point of the ``memascend`` command: a click group whose subcommands live one per module."""

from __future__ import annotations

import importlib
import sys

import click

from memascend.errors import MemascendError

# (module, attribute) of each subcommand; a module is imported only when listed here.
_COMMANDS: tuple[tuple[str, str], ...] = (
    ("memascend.cli.finetune", "finetune"),
    ("memascend.cli.doctor", "doctor"),
    ("memascend.cli.regress", "regress"),
    ("memascend.cli.plan", "plan"),
)


class _Group(click.Group):
    """Turns :class:`MemascendError` (and OS-level input errors) into one line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MemascendError as exc:
            click.echo(f"memascend: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("memascend: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="memascend")
def cli() -> None:
    """memascend: SSD-offloaded LLM fine-tuning with far less host memory (DeepSpeed ZeRO-Infinity)."""


for _mod, _attr in _COMMANDS:
    cli.add_command(getattr(importlib.import_module(_mod), _attr))


def main() -> None:
    import warnings

    # torch.distributed's deprecation notices for calls made inside DeepSpeed fill the log every
    # step; they are not actionable for a user of this CLI.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    cli(prog_name="memascend")
