"""The grouped-kernel route of :func:`jax_mxfp4.ragged_dot` on NVIDIA GPUs: MXFP4 experts through
:mod:`jax_mxfp4.kernels.grouped_wgemm` (each used expert's packed weights read once per ``bm``
rows of its group and decoded in registers; each row meets only its own expert).

Taken for every group size when the kernels are on (``$JAX_MXFP4_KERNELS``) and the platform is
CUDA: on an NVIDIA H200 it beat the bfloat16-decode route from 1 to 4096 tokens of a
gpt-oss-20b-like layer (benchmarks/moe.py, docs/performance.md), whose XLA ragged dot
multiplies every row by every expert.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..array import MXFP4Array
from ..mx_format import as_scale_bytes
from ..platform import kernels_enabled
from .pallas import cuda_capability_reason, decode_for


def why_not(platform: str) -> str:
    """"" when the grouped kernel serves ragged products with MXFP4 experts on ``platform``, else why not."""
    if platform != "cuda":
        return f"the grouped kernel runs on CUDA GPUs, not {platform}"
    if not kernels_enabled():
        return "custom kernels are off ($JAX_MXFP4_KERNELS)"
    return cuda_capability_reason(platform) or ""


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
