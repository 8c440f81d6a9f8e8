"""A storage directory's conformance kit: a flat directory of named files, each written all at
once or not at all, read back byte for byte."""

from __future__ import annotations

import pytest

from ..storage import Directory


class _Abandoned(Exception):
    """Raised inside a write to abandon it."""


class DirectoryTests:
    """Override the ``directory`` fixture to give a fresh, not yet created :class:`Directory`
    (one per test); every test here then runs on it."""

    @pytest.fixture
    def directory(self) -> Directory:
        raise NotImplementedError("a DirectoryTests subclass gives its directory as the 'directory' fixture")

    def test_a_directory_that_does_not_exist_has_no_files(self, directory: Directory) -> None:
        assert not directory.is_dir() and not directory.present()
        assert directory.names() == [] and not directory.exists("a")

    def test_makedirs_may_be_called_again_and_a_file_makes_it_exist(self, directory: Directory) -> None:
        directory.makedirs()
        directory.makedirs()  # an object store has no directories: there this creates nothing
        assert directory.names() == []
        directory.write_bytes("f", b"x")
        assert directory.is_dir() and directory.present() and directory.names() == ["f"]

    def test_files_read_back_byte_for_byte(self, directory: Directory) -> None:
        directory.makedirs()
        payloads = {"a.ckz": bytes(range(256)) * 1000, "empty": b"", "marker.json": b'{"step": 1}'}
        for name, data in payloads.items():
            directory.write_bytes(name, data)
        assert sorted(directory.names()) == sorted(payloads)
        for name, data in payloads.items():
            assert directory.exists(name) and directory.read_bytes(name) == data
            with directory.open_read(name) as stream:
                assert stream.read() == data

    def test_a_write_replaces_a_file_all_at_once(self, directory: Directory) -> None:
        directory.makedirs()
        directory.write_bytes("f", b"old")
        with directory.atomic_write("f") as stream:
            stream.write(b"new ")
            stream.write(b"bytes")
            assert directory.read_bytes("f") == b"old"  # not before the block ends
        assert directory.read_bytes("f") == b"new bytes"

    def test_a_failed_write_leaves_what_was_there(self, directory: Directory) -> None:
        directory.makedirs()
        directory.write_bytes("kept", b"previous")
        for name in ("kept", "fresh"):
            with pytest.raises(_Abandoned), directory.atomic_write(name) as stream:
                stream.write(b"partial")
                raise _Abandoned
        assert directory.read_bytes("kept") == b"previous"
        assert not directory.exists("fresh") and sorted(directory.names()) == ["kept"]

    def test_remove_deletes_and_a_missing_file_is_no_error(self, directory: Directory) -> None:
        directory.makedirs()
        directory.write_bytes("f", b"x")
        directory.remove("f")
        directory.remove("f")
        assert not directory.exists("f") and directory.names() == []

    def test_a_missing_file_raises_file_not_found(self, directory: Directory) -> None:
        directory.makedirs()
        with pytest.raises(FileNotFoundError):
            directory.read_bytes("missing")
        with pytest.raises(FileNotFoundError):
            directory.open_read("missing")

    def test_where_names_the_file_under_the_location(self, directory: Directory) -> None:
        assert directory.where("f.ckz").startswith(directory.location.rstrip("/"))
        assert directory.where("f.ckz").endswith("f.ckz")
