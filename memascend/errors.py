"""Errors with their exit codes.

Every error memascend raises on purpose derives from :class:`MemascendError`; the CLI prints it as
one line (``memascend: error: ...``) and exits with the class's ``exit_code``, without a traceback:

==========  =========================  ====================================================
exit code   class                      meaning
==========  =========================  ====================================================
1           (regression found)         ``memascend regress``: a result is worse than golden
2           :class:`UserError`         bad input or an unusable host; nothing was changed
3           :class:`DeviceError`       the swap target or --output failed during the run (I/O
                                       error, disk full); the last complete checkpoint is intact
4           :class:`IntegrityError`    data read back differs from what was written
                                       (checksum mismatch, damaged checkpoint or store)
5           :class:`TrainingError`     training went wrong although input and devices were
                                       fine (a non-finite loss); nothing was saved from it
==========  =========================  ====================================================
"""

from __future__ import annotations

import os
from pathlib import Path


class MemascendError(Exception):
    """Base of every error the CLI turns into one line. The message names the thing and the fix."""

    exit_code = 1


class UserError(MemascendError):
    """Bad input or an unusable host: a wrong path, a corrupt data line, a too-small device, ...

    The message must be one line and say what to fix.
    """

    exit_code = 2


class DeviceError(MemascendError):
    """The swap target or the --output folder failed while in use: an I/O error, a short transfer, a full disk.

    Not bad input: the command was right, the device was not.
    """

    exit_code = 3


class IntegrityError(MemascendError):
    """Bytes read back differ from what was written: a CRC32C mismatch, a damaged checkpoint file,
    a store header or extent table that does not verify. Names the tensor or file and the offset."""

    exit_code = 4


class TrainingError(MemascendError):
    """Training itself failed: the loss became NaN or infinite (not an fp16 loss-scale skip).

    The run stops before writing a model or a checkpoint from that state. Not bad input and not a
    device failure: lower the learning rate, check the data, or allow it explicitly.
    """

    exit_code = 5


def read_user_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of a file the user named (a config file, a DeepSpeed JSON).

    Args:
        path: the file.
        what: how messages name it (``"config file"``, ``"DeepSpeed config"``).

    Raises:
        UserError: the file is missing ("{what} not found: {path}"), not UTF-8 text (the byte
            offset named) or unreadable (the OS error named).
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}") from None
