"""Conformance kits: pytest test classes that check a codec or a storage directory behaves as
ckptzip relies on, for ckptzip's own and for third-party ones (as zarr ships ``StoreTests``).

Subclass one in a test module named ``test_*.py`` and say what to test::

    from ckptzip.testing import CodecTests

    class TestMyCodec(CodecTests):
        codec_config = {"id": "mycodec", "level": 2}   # registered with ckptzip.codecs.register

Needs pytest (imported here, never by the library).
"""

from .codecs import CodecTests
from .storage import DirectoryTests

__all__ = ["CodecTests", "DirectoryTests"]
