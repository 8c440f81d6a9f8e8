"""How a series names its checkpoints: one file per step, and the names it ignores."""

from __future__ import annotations

import re
import warnings

STEP_NAME = "step_{:08d}.ckz"
# Exactly the names STEP_NAME writes: 8 ASCII digits, or more without a leading zero. Others (such
# as step_000000100.ckz beside step_00000100.ckz, or digits of other scripts, which ``\d`` would
# accept) are not checkpoints of the series: they are ignored, and reported once.
STEP_PATTERN = re.compile(r"step_([0-9]{8}|[1-9][0-9]{8,})\.ckz")
STEP_LIKE = re.compile(r"step_.*\.ckz", re.DOTALL)


class IgnoredFileWarning(UserWarning):
    """Files in a manager's directory are named like checkpoints but not as the manager names
    them (``step_<8 or more ASCII digits>.ckz``, no leading zero beyond eight); they are ignored."""


def name_of(step: int) -> str:
    """The file name of checkpoint ``step``."""
    return STEP_NAME.format(step)


def step_of(name: str) -> int:
    """The step of a name the storage listed (it matches ``STEP_PATTERN``)."""
    return int(name.removeprefix("step_").removesuffix(".ckz"))


def is_step(step: int) -> bool:
    """Whether ``step`` is one the series names (a peer may announce any int64): an int from 0."""
    return step >= 0 and STEP_PATTERN.fullmatch(name_of(step)) is not None


def report_ignored(names: list[str], location: str) -> None:
    """Warn once about files named like checkpoints that are not the series'."""
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    warnings.warn(
        f"ignoring {len(names)} file(s) in {location} named like checkpoints but not as a CheckpointManager "
        f"names them (step_ and 8 or more ASCII digits, no leading zero beyond eight, .ckz): {shown}",
        IgnoredFileWarning,
        stacklevel=4,  # the caller of CheckpointManager(...)
    )
