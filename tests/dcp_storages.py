"""The two DCP storages the compatibility suite runs against: DCP's own FileSystemWriter/Reader
and ckptzip's, with what differs between them (conversion to one file, the overwrite error)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import ckptzip
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter, ckz_to_dcp, dcp_to_ckz


@dataclass(frozen=True)
class Storage:
    name: str
    writer: Callable[..., Any]
    reader: Callable[..., Any]
    #: DCP directory -> one file, one file -> DCP directory, and how that file loads.
    to_file: Callable[[Path, Path], None]
    from_file: Callable[[Path, Path], None]
    load_file: Callable[[Path], Any]
    #: What the writer raises (inside DCP's CheckpointException) for overwrite=False.
    overwrite_error: type[BaseException]
    data_suffix: str

    def __str__(self) -> str:
        return self.name


STORAGES = {
    "dcp": Storage(
        "dcp", FileSystemWriter, FileSystemReader, dcp_to_torch_save, torch_save_to_dcp,
        lambda path: torch.load(path, weights_only=True), RuntimeError, ".distcp",
    ),
    "ckptzip": Storage(
        "ckptzip", CompressedStorageWriter, CompressedStorageReader, dcp_to_ckz, ckz_to_dcp,
        lambda path: ckptzip.load(path), ckptzip.CheckpointWriteError, ".ckzd",
    ),
}
