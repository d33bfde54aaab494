"""``python -m memascend.train.launch TORCHRUN-ARGS``: torchrun without its failure traceback.

``memascend finetune --nproc N`` starts its ranks through torch's launcher (``torch.distributed.run``,
what ``torchrun`` runs). When a rank fails, the ranks have already printed their one
``memascend: error:`` line; torchrun then raises ``ChildFailedError`` and prints a traceback and a
failure table on top of it. This entry point runs the same launcher and exits with the first
failed rank's own exit code instead (2 for bad input, 5 for a non-finite loss, ...; a rank killed
by signal N: 128 + N), so the one line stays the last word and the code keeps its meaning.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``torch.distributed.run.main(argv)``; return 0, or the first failed rank's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # its "Sending process N closing signal" / "failed (exitcode: ...)" log lines repeat what the
    # ranks' own line and the exit code say
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        _rank, failure = exc.get_first_failure()
        code = int(failure.exitcode)  # negative: killed by that signal
        return 128 - code if code < 0 else (code or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
