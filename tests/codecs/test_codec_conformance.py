"""Every built-in codec through the conformance kit that third-party codecs use
(:class:`ckptzip.testing.CodecTests`): the CPU codecs here, nvCOMP's on a GPU."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from ckptzip.codecs import _gdeflate_lib, has_codec
from ckptzip.testing import CodecTests


class TestRaw(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "raw"}
    compresses = False


class TestZstd(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "zstd", "level": 3}


class TestZstdLongMatchesOnly(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "zstd", "level": 1, "long_matches_only": True}


class TestDeflate(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "deflate"}


class TestLz4(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "lz4"}


@pytest.mark.skipif(not has_codec("ckz-huff", "cpu"), reason="ckptzip's ckz-huff coder is not built")
class TestCkzHuff(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "ckz-huff"}


@pytest.mark.skipif(_gdeflate_lib.load()[0] is None or not has_codec("gdeflate", "cpu"),
                    reason="nvCOMP's CPU library (the encoder) is not installed")
class TestGdeflateCpu(CodecTests):
    codec_config: ClassVar[dict[str, Any]] = {"id": "gdeflate", "algorithm_type": 1}


@pytest.mark.gpu
class TestNvcomp(CodecTests):
    """The configurations the engine codes with on a GPU."""

    backend = "cuda"
    # gdeflate's Huffman-only mode codes a byte in one bit at least (8x at most), and raw chunks
    # carry their own tables
    constants_shrink_by = 4

    @pytest.fixture(params=[{"id": "gdeflate", "algorithm_type": 0}, {"id": "gdeflate", "algorithm_type": 1},
                            {"id": "ans", "data_type": "|u1"}, {"id": "zstd"}],
                    ids=lambda c: "-".join(str(v) for v in c.values()))
    def config(self, request: pytest.FixtureRequest) -> dict[str, object]:
        return dict(request.param)


@pytest.mark.gpu
class TestCkzHuffGpu(CodecTests):
    """ckptzip's own coder's kernels (the same bytes as TestCkzHuff's, tests/kernels/test_ckzhuff_kernels.py)."""

    backend = "cuda"
    codec_config: ClassVar[dict[str, Any]] = {"id": "ckz-huff"}
