"""GEMM backends. Each receives the canonical problem (see :mod:`jax_mxfp4.backends.base`)."""
