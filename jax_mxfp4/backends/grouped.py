"""The grouped-kernel route of :func:`jax_mxfp4.ragged_dot` on NVIDIA GPUs: MXFP4 experts at
decode sizes through :mod:`jax_mxfp4.kernels.grouped_wgemm` (each used expert's packed weights
read once per call and decoded in registers).

Taken when the kernels are on (``$JAX_MXFP4_KERNELS``), the platform is CUDA and the groups are
decode-sized: at most :data:`MAX_ROWS_PER_EXPERT` rows per expert on average (M <= that x G).
Larger groups re-read each expert's weights once per ``bm`` rows and go to the bfloat16-decode
route instead (NVIDIA H200, benchmarks/moe.py, docs/performance.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..array import MXFP4Array
from ..mx_format import as_scale_bytes
from ..platform import kernels_enabled
from .pallas import decode_for

MAX_ROWS_PER_EXPERT = 64


def why_not(platform: str, m: int, g: int) -> str:
    """"" when the grouped kernel serves an [M, K] x G-expert product on ``platform``, else why not."""
    if platform != "cuda":
        return f"the grouped kernel runs on CUDA GPUs, not {platform}"
    if not kernels_enabled():
        return "custom kernels are off ($JAX_MXFP4_KERNELS)"
    if m > MAX_ROWS_PER_EXPERT * g:
        return (f"M={m} rows over G={g} experts is more than {MAX_ROWS_PER_EXPERT} rows per expert: the "
                "grouped kernel would re-read each expert's weights per row tile")
    return ""


def grouped_product(a, b: MXFP4Array, group_sizes, k_axis: int, *, interpret: bool = False):
    """float32 [M, N]: the ragged rows product of ``a`` (bfloat16 [M, K], or an MXFP4Array
    decoded exactly to bfloat16) and the experts ``b`` (an MXFP4Array [G, ., .] quantized along
    its contracting dim ``k_axis``, 1 or 2)."""
    from ..kernels.grouped_wgemm import default_grouped_config, grouped_weight_gemm

    x = a.dequantize(jnp.bfloat16) if isinstance(a, MXFP4Array) else a.astype(jnp.bfloat16)
    g, m, k = b.shape[0], x.shape[0], x.shape[1]
    n = b.shape[3 - k_axis]
    cfg = default_grouped_config(m, n, k, g, decode="f16" if interpret else decode_for("cuda"), k_axis=k_axis)
    return grouped_weight_gemm(x, b.data, as_scale_bytes(b.plain_scales()), group_sizes, k_axis=k_axis,
                               out_dtype=jnp.float32, cfg=cfg, interpret=interpret)
