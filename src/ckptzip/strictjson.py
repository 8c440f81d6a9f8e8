"""Strict JSON, the one parser for every JSON document ckptzip reads from a file: UTF-8 (no
byte-order mark), no duplicate keys, no ``NaN``/``Infinity``, nothing after the document."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from .errors import CorruptCheckpointError


def loads(
    raw: bytes | str, what: str, *, error: type[Exception] = CorruptCheckpointError, advice: str = "the file is damaged"
) -> Any:
    """The document in ``raw``; anything else raises ``error`` with a message that starts with
    ``what`` (such as ``"the index"``) and ends with ``advice``."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise error(f"{what} has a JSON object with duplicate keys; {advice}")
        return out

    def no_constant(name: str) -> NoReturn:
        raise error(f"{what} holds the non-JSON constant {name}; {advice}")

    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=unique, parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, integers past Python's digit limit
        if isinstance(exc, error):
            raise
        raise error(f"{what} is not valid UTF-8 JSON ({exc}); {advice}") from exc
