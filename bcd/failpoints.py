"""Named fail points for crash-safety tests, inert unless a test enables one.

``BCD_FAIL_POINT=<name>`` in the environment of ``bcd node`` makes the process kill
itself with SIGKILL once the renewal storage step ``<name>`` is on disk (the names
are :data:`bcd.renew.FAIL_POINTS`). Nothing else reads it; without it the hook is
``None`` and costs nothing.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

ENV = "BCD_FAIL_POINT"


def from_environment(names: tuple[str, ...]) -> Callable[[str], None] | None:
    wanted = os.environ.get(ENV, "")
    if wanted not in names:
        return None

    def hit(name: str) -> None:
        if name == wanted:
            os.kill(os.getpid(), signal.SIGKILL)

    return hit
