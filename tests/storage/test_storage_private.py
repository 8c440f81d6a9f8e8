"""Private directories (storage/private.py), where another user of the machine may write beside
them (a memory tier in /dev/shm): created 0700 by this user, refused when another user owns them
or could write in them or redirect them, never followed through a symbolic link, and only this
user's regular files counted as theirs. Cases with another user's files need root (to chown)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ckptzip.errors import UnsafeLocationError
from ckptzip.storage.private import PrivateDirectory

OTHER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory every user may write in, sticky: as /dev/shm and /tmp are."""
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o1777)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_created_private_with_its_missing_parents(shared: Path) -> None:
    root = PrivateDirectory(shared / f"ckptzip-{os.getuid()}" / "abc")
    child = PrivateDirectory(shared / f"ckptzip-{os.getuid()}" / "abc" / "own", parent=root)
    child.write_bytes("f", b"data")
    for path in (shared / f"ckptzip-{os.getuid()}", root.root, child.root):
        assert _mode(path) == 0o700 and os.lstat(path).st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(child.root / "f").st_mode) == 0o600
    assert child.read_bytes("f") == b"data" and child.names() == ["f"]


def test_a_directory_of_this_user_that_others_could_only_read_is_made_private(shared: Path) -> None:
    (shared / "run").mkdir(mode=0o755)
    os.chmod(shared / "run", 0o755)
    PrivateDirectory(shared / "run").write_bytes("f", b"x")
    assert _mode(shared / "run") == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_a_directory_others_may_write_in_is_refused(shared: Path, mode: int) -> None:
    (shared / "run").mkdir()
    os.chmod(shared / "run", mode)
    (shared / "run" / "planted").write_bytes(b"x")
    with pytest.raises(UnsafeLocationError, match=rf"'{shared}/run' is not a private directory of this user \(it is "
                                                  rf"a directory owned by uid {os.geteuid()}, mode {mode:04o}: others "
                                                  r"may write in it\)"):
        PrivateDirectory(shared / "run").names()
    with pytest.raises(UnsafeLocationError):
        PrivateDirectory(shared / "run").write_bytes("f", b"x")
    assert sorted(os.listdir(shared / "run")) == ["planted"]


def test_a_symbolic_link_in_place_of_the_directory_is_refused(shared: Path, tmp_path: Path) -> None:
    """Whoever owns it: the directory itself is never reached through a link."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (shared / "run").symlink_to(target)
    with pytest.raises(UnsafeLocationError, match=r"is not a private directory of this user \(it is a symbolic link"):
        PrivateDirectory(shared / "run").write_bytes("f", b"x")
    assert os.listdir(target) == []


@as_root
def test_a_parent_that_is_another_users_link_is_refused(shared: Path, tmp_path: Path) -> None:
    """A root whose parent another user took with a link, in a sticky directory: the checkpoints
    went into that user's directory."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (shared / f"ckptzip-{os.getuid()}").symlink_to(target)
    os.lchown(shared / f"ckptzip-{os.getuid()}", OTHER, OTHER)
    with pytest.raises(UnsafeLocationError, match=rf"'{shared}/ckptzip-{os.getuid()}' above it is a symbolic link "
                                                  rf"owned by uid {OTHER}"):
        PrivateDirectory(shared / f"ckptzip-{os.getuid()}" / "abc").write_bytes("f", b"x")
    assert os.listdir(target) == []


def test_a_parent_others_may_write_in_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(UnsafeLocationError, match=rf"'{tmp_path}/open' above it is a directory owned by uid "
                                                  rf"{os.geteuid()}, mode 0777"):
        PrivateDirectory(tmp_path / "open" / "run").makedirs()
    assert os.listdir(tmp_path / "open") == []


def test_links_inside_are_never_followed_and_other_files_are_not_its_files(shared: Path, tmp_path: Path) -> None:
    """A link planted in a tier's shelf made the tier overwrite the file it pointed to."""
    directory = PrivateDirectory(shared / "run")
    directory.write_bytes("mine", b"mine")
    outside = tmp_path / "victim"
    outside.write_bytes(b"victim's")
    os.symlink(outside, shared / "run" / "step_00000003.ckz")
    os.symlink(outside, shared / "run" / "linked")
    os.mkfifo(shared / "run" / "fifo")
    (shared / "run" / "sub").mkdir()
    assert directory.names() == ["mine"]
    assert not directory.exists("linked") and not directory.exists("fifo") and directory.exists("mine")
    for name in ("linked", "fifo", "sub"):
        with pytest.raises(FileNotFoundError):
            directory.open_read(name)  # a FIFO is not waited on
    directory.write_bytes("step_00000003.ckz", b"checkpoint")
    assert outside.read_bytes() == b"victim's"
    assert not (shared / "run" / "step_00000003.ckz").is_symlink()
    assert directory.read_bytes("step_00000003.ckz") == b"checkpoint"
    directory.remove("linked")
    assert outside.exists() and not os.path.lexists(shared / "run" / "linked")
    assert directory.nbytes() == len(b"mine") + len(b"checkpoint")


def test_the_directory_is_reached_through_its_descriptor(shared: Path, tmp_path: Path) -> None:
    """Once opened, a rename of its path (or a link put there) does not move where it writes."""
    directory = PrivateDirectory(shared / "run")
    directory.write_bytes("a", b"1")
    os.rename(shared / "run", tmp_path / "moved")
    (shared / "run").symlink_to(tmp_path / "decoy")
    directory.write_bytes("b", b"2")
    assert sorted(os.listdir(tmp_path / "moved")) == ["a", "b"] and not (tmp_path / "decoy").exists()


@as_root
def test_a_directory_another_user_owns_is_refused(shared: Path) -> None:
    """The default root is predictable: another user who made it first got the checkpoints."""
    (shared / f"ckptzip-{os.getuid()}").mkdir(mode=0o700)
    os.chown(shared / f"ckptzip-{os.getuid()}", OTHER, OTHER)
    with pytest.raises(UnsafeLocationError, match=rf"'{shared}/ckptzip-{os.getuid()}' above it is a directory owned "
                                                  rf"by uid {OTHER}"):
        PrivateDirectory(shared / f"ckptzip-{os.getuid()}" / "abc").makedirs()
    (shared / "run").mkdir(mode=0o700)
    os.chown(shared / "run", OTHER, OTHER)
    with pytest.raises(UnsafeLocationError, match=rf"it is a directory owned by uid {OTHER}, mode 0700, this user is "
                                                  rf"uid {os.geteuid()}"):
        PrivateDirectory(shared / "run").names()


@as_root
def test_files_of_another_user_are_not_its_files(shared: Path) -> None:
    directory = PrivateDirectory(shared / "run")
    directory.write_bytes("mine", b"mine")
    (shared / "run" / "step_99999999.ckz").write_bytes(b"planted")
    os.chown(shared / "run" / "step_99999999.ckz", OTHER, OTHER)
    assert directory.names() == ["mine"] and not directory.exists("step_99999999.ckz")
    with pytest.raises(FileNotFoundError):
        directory.open_read("step_99999999.ckz")
