"""Lossless byte codecs behind one interface (see :class:`Codec`), CPU and GPU implementations."""

import contextlib
import importlib

from ._threads import MIN_PARALLEL_BYTES, codec_thread_count, codec_threads, cpu_threads
from .base import Codec
from .registry import codec_ids, get_codec, gpu_first_ids, gpu_only_ids, has_codec, register

# Importing a codec module registers its codecs. The GPU codecs register themselves only where
# nvCOMP and CUDA are usable; their module never fails to import for want of them.
importlib.import_module(".cpu", __name__)
importlib.import_module(".ckzhuff", __name__)  # ckptzip's own coder of byte planes (declared; compiled C)
importlib.import_module(".gdeflate_cpu", __name__)  # declares gdeflate on the CPU; loads nvCOMP's library on first use
with contextlib.suppress(ImportError):  # pragma: no cover - module absent in a partial install
    importlib.import_module(".nvcomp", __name__)

__all__ = ["MIN_PARALLEL_BYTES", "Codec", "codec_ids", "codec_thread_count", "codec_threads", "cpu_threads", "get_codec",
           "gpu_first_ids", "gpu_only_ids", "has_codec", "register"]
