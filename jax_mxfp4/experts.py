"""The expert GEMM of the Flax expert layers and of the Qwix ``ragged_dot`` interception (one path).

``expert_dot(x [M, K], kernel [E, K, N], group_sizes [E])`` is :func:`jax_mxfp4.ragged_dot` with
the conveniences of the dense layers: any K (a float kernel and the tokens are zero-padded along
K to a multiple of 32, exact: zeros change no block's scale and add nothing), a quantized kernel
(:class:`jax_mxfp4.MXFP4Array` [E, Kp, N] quantized along K, e.g. by
:func:`jax_mxfp4.flax.quantize_params`, which pads K the same way) used as is. :func:`expert_bias`
adds a per-expert bias [E, N] to each group's rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import checks, sharding
from .array import MXFP4Array
from .mx_format import BLOCK_SIZE
from .ragged import ragged_dot
from .training import _pad_axis


def _padded_k(k: int) -> int:
    return -(-k // BLOCK_SIZE) * BLOCK_SIZE


def _operands(x, kernel):
    """(x, kernel) with K padded to a multiple of 32: a float kernel padded along axis 1 (exact),
    or x padded to the K of a quantized kernel; ValueError naming the argument otherwise."""
    checks.check_float_input(x, "inputs")
    if jnp.ndim(x) != 2:
        raise ValueError(f"inputs must be 2-D [M, K] (the tokens sorted by expert), got shape {jnp.shape(x)}")
    if hasattr(kernel, "to_mxfp4"):  # DecodePrepared / FP8Prepared: the same bytes as an MXFP4Array
        kernel = kernel.to_mxfp4()
    k = x.shape[1]
    if jnp.ndim(kernel) != 3:
        raise ValueError(f"kernel must be 3-D [E, K, N] (one [K, N] matrix per expert), got shape {jnp.shape(kernel)}")
    if isinstance(kernel, MXFP4Array):
        kp = kernel.shape[1]
        if kernel.axis != 1:
            raise ValueError(f"kernel: an MXFP4Array expert kernel must be quantized along axis 1 (K of [E, K, N]), "
                             f"got {kernel}")
        if k != kp and _padded_k(k) != kp:
            raise ValueError(f"inputs has K={k} but the MXFP4Array kernel has K={kp}; expected K={kp} or K padded "
                             f"up to it (K rounded up to a multiple of {BLOCK_SIZE})")
        if k != kp:
            sharding.check_dim_blocks(x, 1, "inputs")  # before padding a sharded K
        return _pad_axis(x, 1), kernel
    checks.check_float_input(kernel, "kernel")
    if kernel.shape[1] != k:
        raise ValueError(f"kernel [E, K, N] has K={kernel.shape[1]} but inputs [M, K] has K={k}")
    if k % BLOCK_SIZE:
        for name, v in (("inputs", x), ("kernel", kernel)):
            sharding.check_dim_blocks(v, 1, name)  # before padding a sharded K
    return _pad_axis(x, 1), _pad_axis(kernel, 1)


def expert_dot(x, kernel, group_sizes, recipe, key=None, out_dtype=None):
    """[M, N]: rows ``start_e .. start_e + group_sizes[e] - 1`` of ``x`` times expert ``e``'s [K, N].

    ``x`` float [M, K] (any K); ``kernel`` float [E, K, N] or a quantized kernel [E, Kp, N] along
    axis 1 (Kp = K rounded up to 32); ``group_sizes`` int [E]; ``key`` the stochastic-rounding key
    (or None); ``out_dtype`` None: :func:`jax_mxfp4.ragged_dot`'s. Errors: those of
    :func:`jax_mxfp4.ragged_dot`, and ValueError for ranks and K (naming the argument).
    """
    x, kernel = _operands(x, kernel)
    e = kernel.shape[0]
    if jnp.ndim(group_sizes) == 1 and jnp.shape(group_sizes)[0] != e:
        raise ValueError(f"group_sizes has {jnp.shape(group_sizes)[0]} entries but the kernel has {e} experts "
                         f"(num_experts, dim 0 of [E, K, N]): one size per expert")
    return ragged_dot(x, kernel, group_sizes, preferred_element_type=out_dtype, recipe=recipe, key=key)


def expert_bias(y, bias, group_sizes):
    """``y`` [M, N] plus ``bias[e]`` on the rows of group e (rows past ``sum(group_sizes)``: none,
    they stay zero as the ragged dot leaves them)."""
    checks.check_float_input(bias, "bias")
    e, n = group_sizes.shape[0], y.shape[1]
    if tuple(jnp.shape(bias)) != (e, n):
        raise ValueError(f"bias must have shape ({e}, {n}) ([E, N], one row per expert), got {jnp.shape(bias)}")
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    group_of_row = jnp.searchsorted(ends, jnp.arange(y.shape[0], dtype=jnp.int32), side="right")  # E: no group
    rows = jnp.concatenate([bias, jnp.zeros((1, n), bias.dtype)])[group_of_row]
    return y + rows.astype(y.dtype)
