"""CheckpointManager on an S3-compatible object store: a moto server on 127.0.0.1, reached through s3fs."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from helpers import assert_same
from test_manager import make_state, restore_while_saving

import ckptzip
from ckptzip.errors import CheckpointNotFoundError
from ckptzip.manager import CheckpointManager, CheckpointSkippedWarning

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "ckptzip-tests"


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict[str, Any]]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    s3fs.S3FileSystem(**options).mkdir(BUCKET)
    yield options
    server.stop()


@pytest.fixture
def s3(s3_options: dict[str, Any]) -> Any:
    return s3fs.S3FileSystem(**s3_options)


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def objects(s3: Any, url: str) -> list[str]:
    s3.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in s3.ls(url.removeprefix("s3://"), detail=False))


def test_save_restore_retention_and_commit_markers(s3: Any, s3_options: dict[str, Any], url: str) -> None:
    with CheckpointManager(url, keep_last=2, storage_options=s3_options) as manager:
        for step in (1, 2, 3):
            manager.save(step, make_state(step))
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert objects(s3, url) == [
        "step_00000002.ckz",
        "step_00000002.ckz.commit",
        "step_00000003.ckz",
        "step_00000003.ckz.commit",
    ]
    data = s3.cat_file(f"{url}/step_00000003.ckz")
    assert json.loads(s3.cat_file(f"{url}/step_00000003.ckz.commit")) == {
        "format": "ckptzip-commit",
        "version": 1,
        "name": "step_00000003.ckz",
        "size": len(data),
        "xxh3_64": xxhash.xxh3_64_hexdigest(data),
    }
    assert_same(ckptzip.load(io.BytesIO(data)), make_state(3))  # each object is a plain .ckz file
    reader = CheckpointManager(url, storage_options=s3_options)
    assert_same(reader.restore(), make_state(3))
    assert_same(reader.restore(2), make_state(2))


def test_object_without_marker_is_invisible_until_the_writer_cleans_it(
    s3: Any, s3_options: dict[str, Any], url: str
) -> None:
    with CheckpointManager(url, storage_options=s3_options) as manager:
        manager.save(1, make_state(1))
    buffer = io.BytesIO()
    ckptzip.save(make_state(9), buffer)
    s3.pipe_file(f"{url}/step_00000009.ckz", buffer.getvalue())  # a writer died before its marker

    reader = CheckpointManager(url, storage_options=s3_options)
    assert reader.all_steps() == [1]
    assert_same(reader.restore(), make_state(1))
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint of step 9 .*committed steps: \[1\]"):
        reader.restore(9)
    reader.close()
    assert "step_00000009.ckz" in objects(s3, url)  # readers never delete

    with CheckpointManager(url, storage_options=s3_options) as writer:
        writer.save(2, make_state(2))
    assert objects(s3, url) == [
        "step_00000001.ckz",
        "step_00000001.ckz.commit",
        "step_00000002.ckz",
        "step_00000002.ckz.commit",
    ]


def test_object_replaced_after_commit_is_skipped(s3: Any, s3_options: dict[str, Any], url: str) -> None:
    with CheckpointManager(url, storage_options=s3_options) as manager:
        manager.save(1, make_state(1))
        manager.save(2, make_state(2))
    buffer = io.BytesIO()
    ckptzip.save(make_state(3), buffer)  # a valid .ckz file, but not the committed one
    s3.pipe_file(f"{url}/step_00000002.ckz", buffer.getvalue())
    with pytest.warns(CheckpointSkippedWarning, match="step 2 .*but its commit marker records"):
        assert_same(manager.restore(), make_state(1))


def test_concurrent_reader_sees_only_committed_checkpoints(s3_options: dict[str, Any], url: str) -> None:
    reader = CheckpointManager(url, storage_options=s3_options)
    writer = CheckpointManager(url, keep_last=1, storage_options=s3_options)
    restored = restore_while_saving(reader, writer, 8, 200_000)
    assert len(set(restored)) >= 2 and restored == sorted(restored)


def test_incremental_chains_retention_and_a_missing_base(s3: Any, s3_options: dict[str, Any], url: str) -> None:
    from test_manager_incremental import run_state

    from ckptzip.errors import MissingBaseError

    with CheckpointManager(url, keep_last=2, incremental=3, storage_options=s3_options) as manager:
        for step in range(1, 5):
            manager.save(step, run_state(step))
        manager.wait()
        assert manager.all_steps() == [1, 2, 3, 4]  # the retained 3 needs 2 and 1
        for step in range(1, 5):
            assert_same(manager.restore(step), run_state(step))
    s3.rm_file(f"{url}/step_00000002.ckz.commit")  # un-commit a base
    reader = CheckpointManager(url, storage_options=s3_options)
    with pytest.raises(MissingBaseError, match=r"against step 2, 'step_00000002.ckz'.* which is missing"):
        reader.restore(3)
    assert_same(reader.restore(), run_state(4))
