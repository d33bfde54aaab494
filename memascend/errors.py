"""User-facing errors.

Anything raised as :class:`UserError` is printed by the CLI as one line (``memascend: error: ...``)
and the process exits with code 2, without a traceback.
"""


class UserError(Exception):
    """Bad input or an unusable host: a wrong path, a corrupt data line, a too-small device, ...

    The message must be one line and say what to fix.
    """

    exit_code = 2
