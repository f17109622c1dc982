"""The all-pairs scale-byte GEMM check shared by tests/test_scale_range.py (CPU) and
tests/gpu/test_gpu_scale_range.py (device): one GEMM over every pair of E8M0 scale bytes
(tests/mx_reference.scale_pair_operands), each output held to the backend's own contract
(Backend.numerics) against the float64 reference (mx_reference.scale_pair_reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from mx_reference import pack_ref, scale_pair_failures, scale_pair_operands, scale_pair_reference

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.checks import canonical_precision
from jax_mxfp4.mx_format import as_e8m0

DN = (((1,), (1,)), ((), ()))
ROWS = 256


def _mx(codes, sb):
    return mx.MXFP4Array(jnp.asarray(pack_ref(codes, 1)), as_e8m0(jnp.asarray(sb)), 1, codes.shape, jnp.float32)


def check_scale_pairs(backend, pattern, out_dtype=jnp.float32, k=32, form="plain", batch_rows=None,
                      float_lhs=False, precision=None):
    """Run ``backend`` on the all-pairs GEMM; assert every output is within its contract.
    ``form``: "plain" MXFP4Arrays, "fp8" (rhs through prepare_fp8) or "decode" (rhs through
    prepare_decode). ``batch_rows``: split the lhs into batches of this many rows (decode-size
    routes), each against the whole rhs. ``float_lhs``: the lhs as its exact bfloat16 values
    (w4a16: only the rhs is decoded by the backend). ``precision``: of the GEMM ("default" if None)."""
    cl, bl, cr, br = scale_pair_operands(pattern, k)
    a, b = _mx(cl, bl), _mx(cr, br)
    recipe = mx.Recipe(backend=backend, quantize_activations=not float_lhs)
    pet = jnp.dtype(out_dtype)
    prepare = {"plain": lambda v: v, "fp8": mx.prepare_fp8, "decode": mx.prepare_decode}[form]
    if batch_rows:
        nb = ROWS // batch_rows
        a = mx.MXFP4Array(a.data.reshape(nb, batch_rows, -1), a.scales.reshape(nb, batch_rows, -1), 2,
                          (nb, batch_rows, k), jnp.float32)
        rep = lambda v: jnp.broadcast_to(v, (nb, *v.shape))  # noqa: E731
        b = mx.MXFP4Array(rep(b.data), rep(b.scales), 2, (nb, ROWS, k), jnp.float32)
        dn = (((2,), (2,)), ((0,), (0,)))
    else:
        dn = DN
    a = mx.dequantize(a, jnp.bfloat16) if float_lhs else a
    b = prepare(b)
    fn = jax.jit(lambda x, y: mx.dot_general(x, y, dn, precision=precision, preferred_element_type=pet, recipe=recipe))
    got = np.asarray(fn(a, b).astype(jnp.float32)).reshape(ROWS, ROWS)
    route = mx.explain(a, b, dn, precision=precision, preferred_element_type=pet, recipe=recipe).route
    exact, abs_dot, nan_byte, overflow = scale_pair_reference(cl, bl, cr, br)
    problem = GemmProblem(1, ROWS, ROWS, k, np.dtype(pet), "plain", dispatch.current_platform(),
                          precision=canonical_precision(precision))
    bound = dispatch.get_backend(backend).numerics(problem).bound(exact, abs_dot, k, pet)
    bad = scale_pair_failures(got, exact, abs_dot, nan_byte, overflow, bound)
    where = [(f"0x{i:02X}", f"0x{j:02X}", float(got[i, j]), float(exact[i, j])) for i, j in np.argwhere(bad)[:6]]
    assert not bad.any(), f"{backend} ({route}) {pattern} {form}: {int(bad.sum())} pairs off, (lhs byte, rhs byte, got, exact): {where}"
    assert np.isnan(got[255]).all() and np.isnan(got[:, 255]).all()
    # the pair the faults were about: 6 x 2^-127 against 6 x 2^125 (bytes 0x00, 0xFC) is ordinary
    if pattern == "six":
        assert exact[0, 0xFC] == 32 * 36 * 2.0**-2 and got[0, 0xFC] == exact[0, 0xFC]


