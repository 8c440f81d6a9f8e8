"""A value each thread sets for the code it runs within a block (:class:`ThreadSetting`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadSetting(Generic[T]):
    """A value per thread, None until a thread sets it for a block (:meth:`within`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> T | None:
        value: T | None = getattr(self._local, "value", None)
        return value

    @contextlib.contextmanager
    def within(self, value: T | None) -> Iterator[None]:
        """This thread's value is ``value`` inside the block, what it was before after it."""
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
