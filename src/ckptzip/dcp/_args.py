"""The arguments of DCP's ``FileSystemWriter`` / ``FileSystemReader`` that ckptzip's storage
takes too: what each means for it, and why the ones it cannot act on are refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import UsageError


def check_extensions(extensions: Sequence[Any] | None) -> None:
    """Refuse DCP stream extensions (``_extensions=``) with the reason; none or ``[]`` is fine.

    A DCP extension rewrites each item's byte stream. ckptzip's data files are ``.ckz``
    containers read by position (a rank's items decoded in batches, every chunk checksummed),
    which a stream transform would hide, and compression is what ckptzip's own coding does.
    """
    for extension in extensions or ():
        name = type(extension).__name__
        registry = getattr(extension, "registry_name", None)
        descriptor = registry() if callable(registry) else name
        if descriptor == "stream.zstd":
            raise UsageError(
                f"_extensions=[{name}()]: ckptzip already compresses every item (zstd on the structured "
                "byte planes of each tensor, every chunk checksummed), so DCP's zstd stream extension "
                "would compress compressed bytes; drop _extensions (codec= chooses ckptzip's coding)"
            )
        raise UsageError(
            f"_extensions=[{name}] ({descriptor}): ckptzip's data files are .ckz containers read by "
            "position, which a DCP stream transform would hide; ckptzip composes with no stream "
            "extension. Save with FileSystemWriter to use it, or drop _extensions"
        )


def check_serialization_format(serialization_format: Any) -> None:
    """Accept DCP's default ``SerializationFormat.TORCH_SAVE`` (tensors are stored in ckptzip's
    format, other values as ``torch.save`` bytes either way); refuse safetensors output."""
    value = getattr(serialization_format, "value", serialization_format)
    if serialization_format is None or value == "torch_save":
        return
    raise UsageError(
        f"serialization_format={serialization_format}: ckptzip stores tensors in .ckz containers, not "
        f"{value} files; leave it at SerializationFormat.TORCH_SAVE, or save with FileSystemWriter "
        "(or torch's HuggingFaceStorageWriter) for safetensors output"
    )
