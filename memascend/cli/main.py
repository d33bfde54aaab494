"""Entry point of the ``memascend`` command: a click group whose subcommands live one per module."""

from __future__ import annotations

import importlib
import os
import sys

import click

from memascend.errors import MemascendError

# (module, attribute) of each subcommand; a module is imported only when listed here.
_COMMANDS: tuple[tuple[str, str], ...] = (
    ("memascend.cli.finetune", "finetune"),
    ("memascend.cli.doctor", "doctor"),
    ("memascend.cli.regress", "regress"),
    ("memascend.cli.plan", "plan"),
    ("memascend.cli.run", "run"),
)


def usage_error_line(exc: click.ClickException) -> str:
    """The one-line form of a click error: its message, and for a usage error the help to read.

    Click prints ``Usage: ...`` / ``Try ... for help.`` / ``Error: ...`` (three lines); memascend
    prints every bad input as the one ``memascend: error: ...`` line.
    """
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        message = f"{message} (see '{ctx.command_path} --help')"
    return message


class _Group(click.Group):
    """Prints every error as one ``memascend: error: ...`` line on stderr and exits with its code:
    :class:`MemascendError` with the class's code, click's usage errors (a bad option value, an
    unknown option, a missing argument) with 2, Ctrl-C with 130. ``--help`` and ``--version`` work
    as usual; ``memascend`` without a command prints the help."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"memascend: error: {usage_error_line(exc)}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("memascend: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # output piped into `head` and the like, as click's standalone mode
            sys.stderr = sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter closes it at exit
            sys.exit(1)
        # Without standalone mode click returns the code of an explicit exit (--help, --version)
        # or the command's return value (None).
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        # A rank of a supervised launch with several ranks: the launch prints each line once
        # (memascend.train.run_state.say_error); elsewhere it is printed as it is.
        from memascend.train.run_state import say_error

        try:
            return super().invoke(ctx)
        except MemascendError as exc:
            say_error(f"memascend: error: {exc}")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            say_error("memascend: interrupted")
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="memascend")
# The deepspeed launcher (`deepspeed --module memascend finetune ...`) puts --local_rank=N before the
# subcommand; the LOCAL_RANK it also sets is what memascend reads, so the option is taken and dropped.
@click.option("--local_rank", "--local-rank", "local_rank", type=int, default=None, hidden=True, expose_value=False,
              help="Ignored (the deepspeed launcher passes it; LOCAL_RANK from the environment is used)")
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
