# The compiled GDeflate decoder (_gdeflate.c).
import numpy as np

def decode(rows: np.ndarray, sizes: np.ndarray, /) -> tuple[int, str] | None: ...
