"""A codec's conformance kit: lossless, chunk by chunk, in batches, on views, with damage
reported as ``CorruptCheckpointError``, and a configuration that rebuilds it."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from ..codecs import Codec, get_codec
from ..errors import CorruptCheckpointError


def sample_chunks(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Byte chunks of the kinds a checkpoint holds (noise, zeros, a constant, fp32 and bf16
    values, integers, one byte), as 1-D uint8 tensors on ``device``."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    chunks = {
        "random": torch.from_numpy(np.frombuffer(rng.bytes(70_000), dtype=np.uint8).copy()),
        "zeros": torch.zeros(65_536, dtype=torch.uint8),
        "constant": torch.full((12_345,), 0xA5, dtype=torch.uint8),
        "floats": torch.randn(5000, generator=g).view(torch.uint8),
        "bf16": torch.randn(9000, generator=g).bfloat16().view(torch.uint8),
        "ramp": torch.arange(3000, dtype=torch.int32).view(torch.uint8),
        "one byte": torch.tensor([7], dtype=torch.uint8),
    }
    return {name: chunk.to(device) for name, chunk in chunks.items()}


class CodecTests:
    """Set ``codec_config`` (and ``backend``: ``"cpu"`` or ``"cuda"``), or override the ``config``
    fixture (parametrized: several configurations); every test here then runs on that codec.
    ``compresses`` says whether zeros and constants must shrink (False for a codec that stores),
    ``constants_shrink_by`` by how much at least."""

    codec_config: ClassVar[dict[str, Any]]
    backend: ClassVar[str] = "cpu"
    compresses: ClassVar[bool] = True
    constants_shrink_by: ClassVar[int] = 50

    @pytest.fixture
    def config(self) -> dict[str, Any]:
        return self.codec_config

    @pytest.fixture
    def codec(self, config: dict[str, Any]) -> Codec:
        if self.backend == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return get_codec(config, self.backend)

    @pytest.fixture
    def chunks(self) -> dict[str, torch.Tensor]:
        return sample_chunks(self.backend)

    def _fit(self, codec: Codec, chunk: torch.Tensor) -> torch.Tensor:
        return chunk[: codec.max_chunk_bytes]

    def test_every_kind_of_chunk_round_trips_bit_exactly(self, codec: Codec, chunks: dict[str, torch.Tensor]) -> None:
        for name, chunk in chunks.items():
            chunk = self._fit(codec, chunk)
            (encoded,) = codec.encode([chunk])
            assert encoded.dtype == torch.uint8 and encoded.dim() == 1, name
            (decoded,) = codec.decode([encoded], [chunk.numel()])
            assert torch.equal(decoded, chunk), name
            if self.compresses and name in ("zeros", "constant"):
                ratio = chunk.numel() / encoded.numel()
                assert ratio > self.constants_shrink_by, f"{name} shrank {ratio:.1f}x, not {self.constants_shrink_by}x"

    def test_a_batch_is_coded_chunk_by_chunk(self, codec: Codec, chunks: dict[str, torch.Tensor]) -> None:
        batch = [self._fit(codec, c) for c in chunks.values()] * 20  # > 1 MiB in all: a CPU codec's thread pool
        encoded = codec.encode(batch)
        assert len(encoded) == len(batch)
        alone = [codec.encode([c])[0] for c in batch[: len(chunks)]]
        decoded = codec.decode(encoded, [c.numel() for c in batch])
        assert all(torch.equal(d, c) for d, c in zip(decoded, batch))
        assert all(torch.equal(codec.decode([a], [c.numel()])[0], c) for a, c in zip(alone, batch))
        assert codec.encode([]) == [] and codec.decode([], []) == []

    def test_views_of_a_larger_tensor_code_as_their_own_bytes(self, codec: Codec,
                                                              chunks: dict[str, torch.Tensor]) -> None:
        base = chunks["ramp"]
        pieces = list(base.split(1000))  # views with storage offsets, as the engine makes them
        decoded = codec.decode(codec.encode(pieces), [p.numel() for p in pieces])
        assert torch.equal(torch.cat(decoded), base)

    @pytest.mark.parametrize("delta", [-1, 1, 1000])
    def test_a_wrong_decoded_size_is_corrupt_and_names_the_chunk(self, codec: Codec,
                                                                 chunks: dict[str, torch.Tensor],
                                                                 delta: int) -> None:
        if not codec.sizes_in_stream:
            pytest.skip(f"{codec.codec_id} chunks do not declare their decoded size (the tensor checksum catches it)")
        chunk = self._fit(codec, chunks["floats"])
        encoded = codec.encode([chunk[:100], chunk])
        with pytest.raises(CorruptCheckpointError, match=rf"\b{re.escape(codec.codec_id)} chunk 1\b"):
            codec.decode(encoded, [100, chunk.numel() + delta])

    def test_segments_of_one_buffer_code_as_the_chunks_do(self, codec: Codec,
                                                          chunks: dict[str, torch.Tensor]) -> None:
        align = max(256, codec.alignment)
        base = torch.cat([chunks["floats"], chunks["zeros"][:4096], chunks["bf16"]])[: 16 * 1024 // align * align]
        lengths = np.array([align * 4, align * 8, align * 2], dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        coded, coded_offsets, coded_lengths = codec.encode_segments(base, offsets, lengths)
        out = torch.zeros(int(lengths.sum()), dtype=torch.uint8, device=base.device)
        codec.decode_segments(coded, coded_offsets, coded_lengths, out, offsets, lengths)
        assert torch.equal(out, base[: int(lengths.sum())])

    def test_queued_segments_give_what_encoding_them_at_once_gives(self, codec: Codec,
                                                                   chunks: dict[str, torch.Tensor]) -> None:
        align = max(256, codec.alignment)
        base = torch.cat([chunks["floats"], chunks["bf16"]])[: 16 * 1024 // align * align]
        lengths = np.array([align * 4, align * 8], dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        first = codec.queue_segments(base, offsets[:1], lengths[:1])
        second = codec.queue_segments(base, offsets[1:], lengths[1:])  # queued behind the first
        for queued, at in ((second, slice(1, 2)), (first, slice(0, 1))):  # asked for in the other order
            got, got_offsets, got_lengths = queued()
            want, want_offsets, want_lengths = codec.encode_segments(base, offsets[at], lengths[at])
            assert got_lengths.tolist() == want_lengths.tolist()
            assert torch.equal(got[int(got_offsets[0]):][: int(got_lengths[0])],
                               want[int(want_offsets[0]):][: int(want_lengths[0])])

    def test_its_chunks_decode_with_the_codec_of_its_decoder_configuration(
            self, codec: Codec, chunks: dict[str, torch.Tensor]) -> None:
        decoder = get_codec(codec.decoder_config(), self.backend)
        assert decoder.decoder_config() == codec.decoder_config()
        batch = [self._fit(codec, c) for c in chunks.values()]
        decoded = decoder.decode(codec.encode(batch), [c.numel() for c in batch])
        assert all(torch.equal(d, c) for d, c in zip(decoded, batch))

    def test_its_configuration_rebuilds_an_equal_codec(self, codec: Codec) -> None:
        config = codec.get_config()
        assert config["id"] == codec.codec_id
        assert get_codec(config, self.backend) == codec
        assert hash(get_codec(config, self.backend)) == hash(codec)

    def test_its_facts_are_usable(self, codec: Codec) -> None:
        assert codec.backend == self.backend
        assert codec.chunk_bytes > 0 and codec.chunk_bytes % 256 == 0
        assert codec.chunk_bytes <= codec.max_chunk_bytes and codec.alignment >= 1
