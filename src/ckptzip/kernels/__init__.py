"""GPU kernels (Triton) for the transforms and checksums; torch fallbacks elsewhere."""
