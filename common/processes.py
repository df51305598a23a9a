"""Child processes that do not outlive their parent.

`rlbus up` starts its components, and a sharded `rlbus trainer` its ranks, as
children that must go when the parent goes, even when it is SIGKILLed and
has no chance to stop them: Linux's PR_SET_PDEATHSIG sends them SIGTERM.
"""

from __future__ import annotations

import os
import signal


def terminate_with(parent: int) -> None:
    """In a child, before exec: get SIGTERM when `parent` dies, even by SIGKILL (elsewhere than Linux: nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)
