"""Lossless byte codecs behind one interface (see :class:`Codec`), CPU and GPU implementations."""

from . import cpu as _cpu  # noqa: F401  (registers the CPU codecs)
from .base import Codec
from .registry import codec_ids, get_codec, gpu_only_ids, has_codec, register

try:  # GPU codecs register themselves when nvCOMP and CUDA are usable; never fails to import.
    from . import nvcomp as _nvcomp  # noqa: F401
except ImportError:  # pragma: no cover - module absent in a partial install
    pass

__all__ = ["Codec", "codec_ids", "get_codec", "gpu_only_ids", "has_codec", "register"]
