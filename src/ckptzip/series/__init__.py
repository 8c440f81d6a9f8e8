"""A checkpoint series: one file per step in a storage, some stored as XOR deltas against an
earlier one. What the manager and its memory tier both need, below both:

- :mod:`.naming`: a step's file name (``step_00000042.ckz``), and the names that are ignored.
- :mod:`.retention`: which steps to keep: the newest few and every base their chains need.
- :mod:`.bases`: :class:`Series`, the steps of one storage and the one cached answer to "which
  step is N's base", forgotten when N is deleted or replaced.
"""

from .bases import Files, Series, read_base
from .naming import STEP_LIKE, STEP_NAME, STEP_PATTERN, IgnoredFileWarning, is_step, name_of, report_ignored, step_of
from .retention import removable, retained

__all__ = ["STEP_LIKE", "STEP_NAME", "STEP_PATTERN", "Files", "IgnoredFileWarning", "Series", "is_step", "name_of",
           "read_base", "removable", "report_ignored", "retained", "step_of"]
