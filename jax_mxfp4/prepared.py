"""What the weight forms arranged once from an MXFP4Array share (:class:`jax_mxfp4.FP8Prepared`,
:class:`jax_mxfp4.DecodePrepared`): the logical ``shape``/``ndim``/``size``, ``dequantize`` through
the exact round trip ``to_mxfp4()``, and the refusal to pass for a dense array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class PreparedWeight:
    """Mixin: a subclass has static ``shape``, a method ``to_mxfp4()`` (bit-exact) and a class
    attribute ``holds`` (what its children are, for the error text)."""

    holds = "a prepared MXFP4 weight"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """Same values as ``jax_mxfp4.dequantize(self.to_mxfp4(), dtype)`` (logical shape)."""
        return self.to_mxfp4().dequantize(dtype)

    def _not_dense(self, how: str) -> TypeError:
        return TypeError(
            f"{how} on {self!r}: {self.holds}, not a dense array; decode it with q.dequantize(dtype), or "
            "get the exact MXFP4Array back with q.to_mxfp4()")

    def __array__(self, dtype=None, copy=None):
        raise self._not_dense("np.asarray/np.array")

    def __jax_array__(self):
        raise self._not_dense("jnp.asarray/jnp.array")
