"""DecodePrepared / prepare_decode: an MXFP4 weight arranged once for decode-size GEMMs.

The layout is checked against NumPy moves of the MXFP4Array's own bytes (data: quantized axis
last; scales: K-major), the round trip bit for bit on random codes and every E8M0 byte (NaN
included), and products against the float64 reference of tests/mx_reference.py and against the
same product with the MXFP4Array. The CUDA lowering of the dispatch route (Mosaic GPU kernel,
compute capability patched to 9.0) is inspected for transposes of the packed weight.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import checkpoint
from jax_mxfp4.decode_prepared import DecodePrepared, canonical, pair_order_bytes, prepare_decode
from mx_reference import dequantize_ref, lanes_ref, pack_ref, pairs_from_lanes_ref, pairs_source_index, qdq

XLA = mx.Recipe(backend="xla")
W4A16_PALLAS = mx.Recipe(backend="pallas", quantize_activations=False)


def mk(rng, shape, axis, every_byte=False):
    """(MXFP4Array, codes, scale bytes) with random codes and random (or all 256) E8M0 bytes."""
    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    sshape = list(shape)
    sshape[axis] //= 32
    if every_byte:
        sb = np.resize(rng.permutation(256).astype(np.uint8), sshape)  # every byte incl. 0xFF (NaN)
    else:
        sb = rng.integers(118, 136, size=sshape).astype(np.uint8)  # finite, moderate magnitudes
    q = mx.MXFP4Array(jnp.asarray(pack_ref(codes, axis)), jnp.asarray(sb).view(jnp.float8_e8m0fnu), axis,
                      tuple(shape), jnp.float32)
    return q, codes, sb


def u8(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.sweep(keep=12)
# ------------------------------------------------------------------ layout and round trip
@pytest.mark.parametrize("shape,axis", [((96, 40), 0), ((40, 96), 1), ((64, 5, 7), 0), ((3, 64, 7), 1),
                                        ((3, 5, 64), 2), ((256,), 0)])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("byte_order", ["natural", "lanes"])
def test_layout_and_round_trip_bit_exact_every_e8m0_byte(shape, axis, layout, byte_order, rng):
    q, codes, sb = mk(rng, shape, axis, every_byte=True)
    q = q.with_scale_layout(layout)
    p = prepare_decode(q, byte_order=byte_order) if byte_order != "lanes" else prepare_decode(q)  # "lanes": the default
    assert isinstance(p, DecodePrepared) and (p.shape, p.axis, p.dtype) == (q.shape, q.axis, q.dtype)
    assert p.byte_order == byte_order
    # layout (module docstring), from NumPy moves of the bytes
    want_data = np.moveaxis(pack_ref(codes, axis), axis, -1)
    if byte_order == "lanes":  # stored byte 16b + 4g + t = natural byte 16b + g + 4t, nibbles regrouped
        want_data = lanes_ref(want_data[..., pairs_source_index(want_data.shape[-1])])
    want_scales = np.moveaxis(sb, axis, -1)
    if want_scales.ndim >= 2:
        want_scales = np.swapaxes(want_scales, -1, -2)
    np.testing.assert_array_equal(u8(p.data), want_data)
    np.testing.assert_array_equal(u8(p.scales), want_scales)
    assert p.scales.dtype == jnp.float8_e8m0fnu and p.nbytes == q.with_scale_layout("plain").nbytes
    back = p.to_mxfp4()
    assert back.scale_layout == "plain" and (back.shape, back.axis, back.dtype) == (q.shape, q.axis, q.dtype)
    np.testing.assert_array_equal(u8(back.data), u8(q.data))
    np.testing.assert_array_equal(u8(back.scales), sb)
    got = np.asarray(p.dequantize())
    want = dequantize_ref(codes, sb, axis)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # 0xFF blocks decode to NaN
    np.testing.assert_array_equal(got, np.asarray(mx.dequantize(q)))


def test_hadamard_and_scale_mode_survive_the_round_trip(rng):
    q, _, _ = mk(rng, (64, 32), 0)
    q = dataclasses.replace(q, scale_mode="floor", hadamard=(32, 7))
    p = prepare_decode(q)
    assert (p.scale_mode, p.hadamard) == ("floor", (32, 7)) and "hadamard=(32, 7)" in repr(p)
    back = p.to_mxfp4()
    assert (back.scale_mode, back.hadamard) == ("floor", (32, 7))


# ------------------------------------------------------------------ canonical form
@pytest.mark.parametrize("shape,axis,contracting,batch", [
    ((96, 40), 0, (0,), ()),  # Flax kernel [K, N]
    ((40, 96), 1, (1,), ()),  # [N, K]
    ((3, 64, 40), 1, (1,), (0,)),  # stacked [L, K, N], L batch
    ((3, 40, 64), 2, (2,), (0,)),  # stacked [L, N, K]
])
def test_canonical_reshapes_only_in_the_common_orders(shape, axis, contracting, batch, rng):
    q, codes, sb = mk(rng, shape, axis)
    p = prepare_decode(q)
    jaxpr = jax.make_jaxpr(lambda d, s: jax.tree_util.tree_leaves(
        canonical(DecodePrepared(d, s, p.axis, p.shape, p.dtype), contracting, batch)))(p.data, p.scales)
    assert "transpose" not in str(jaxpr)
    c = canonical(p, contracting, batch)
    np.testing.assert_array_equal(np.asarray(c.dequantize()),
                                  np.asarray(mx.dequantize(q)).transpose(batch + tuple(
                                      d for d in range(len(shape)) if d not in batch + contracting) + contracting
                                  ).reshape(c.shape))


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("shape,axis,contracting,batch", [
    ((64, 5, 7), 0, (0,), ()),  # two free dims: scales transposed
    ((5, 3, 64), 2, (2,), (1,)),  # batch dim after a free dim: data transposed
    ((4, 64), 1, (1,), (0,)),  # no free dim
])
def test_canonical_other_orders_are_correct(shape, axis, contracting, batch, rng):
    q, _, _ = mk(rng, shape, axis, every_byte=True)
    c = canonical(prepare_decode(q), contracting, batch)
    free = tuple(d for d in range(len(shape)) if d not in batch + contracting)
    want = np.asarray(mx.dequantize(q)).transpose(batch + free + contracting).reshape(c.shape)
    got = np.asarray(c.dequantize())
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


# ------------------------------------------------------------------ products
CASES = {
    "[K,N] axis 0": ((256, 64), 0, (8, 256), (((1,), (0,)), ((), ()))),
    "[N,K] axis 1": ((64, 256), 1, (8, 256), (((1,), (1,)), ((), ()))),
    "[B,K,N] axis 1": ((3, 128, 64), 1, (3, 5, 128), (((2,), (1,)), ((0,), (0,)))),
    "[K,H,D] axis 0": ((128, 4, 16), 0, (6, 128), (((1,), (0,)), ((), ()))),
}


def ref_product(x, codes, sb, axis, dn):
    w = dequantize_ref(codes, sb, axis)
    return jax.lax.dot_general(jnp.asarray(np.asarray(x, np.float64), jnp.float32), jnp.asarray(w, jnp.float32), dn,
                               precision="highest"), w


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("case", sorted(CASES))
def test_dot_general_equals_the_mxfp4array_product_xla(case, rng):
    wshape, axis, xshape, dn = CASES[case]
    q, codes, sb = mk(rng, wshape, axis)
    x = jnp.asarray(rng.standard_normal(xshape), jnp.float32)
    p = prepare_decode(q)
    got = np.asarray(mx.dot_general(x, p, dn, recipe=XLA))
    np.testing.assert_array_equal(got, np.asarray(mx.dot_general(x, q, dn, recipe=XLA)))
    # independent check: float64 product of the dequantized reference with x's own MXFP4 values
    xq = np.asarray(mx.dequantize(mx.quantize(x, len(xshape) - 1)), np.float64)
    want = np.einsum("...k,kn->...n", xq, dequantize_ref(codes, sb, axis).reshape(wshape[0], -1)) if case in (
        "[K,N] axis 0", "[K,H,D] axis 0") else None
    if want is not None:
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # w4a16 (x kept float): same equality; the "lanes" byte order too
    w4 = mx.Recipe(backend="xla", quantize_activations=False)
    np.testing.assert_array_equal(np.asarray(mx.dot_general(x, p, dn, recipe=w4)),
                                  np.asarray(mx.dot_general(x, q, dn, recipe=w4)))
    np.testing.assert_array_equal(np.asarray(mx.dot_general(x, prepare_decode(q, "lanes"), dn, recipe=w4)),
                                  np.asarray(mx.dot_general(x, q, dn, recipe=w4)))


@pytest.mark.parametrize("case", ["[K,N] axis 0", "[N,K] axis 1", "[B,K,N] axis 1"])
def test_dot_general_pallas_interpreter_w4a16(case, rng):
    wshape, axis, xshape, dn = CASES[case]
    q, codes, sb = mk(rng, wshape, axis)
    x = jnp.asarray(rng.standard_normal(xshape), jnp.bfloat16)
    got = np.asarray(mx.dot_general(x, prepare_decode(q), dn, preferred_element_type=jnp.float32, recipe=W4A16_PALLAS))
    np.testing.assert_array_equal(got, np.asarray(mx.dot_general(x, q, dn, preferred_element_type=jnp.float32,
                                                                 recipe=W4A16_PALLAS)))
    want = np.asarray(jax.lax.dot_general(x.astype(jnp.float32), jnp.asarray(dequantize_ref(codes, sb, axis),
                                                                             jnp.float32), dn, precision="highest"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_prepared_on_the_lhs_and_facing_other_quantized_operands(rng):
    qa, _, _ = mk(rng, (8, 128), 1)  # an activation [M, K]
    qw, _, _ = mk(rng, (128, 64), 0)  # a weight [K, N]
    dn = (((1,), (0,)), ((), ()))
    ref = np.asarray(mx.dot_general(qa, qw, dn, recipe=XLA))
    for a, b, recipe in ((prepare_decode(qa), qw, XLA), (qa, prepare_decode(qw), XLA),
                         (prepare_decode(qa), prepare_decode(qw), XLA),
                         (mx.prepare_fp8(qa), prepare_decode(qw), XLA),
                         (prepare_decode(qa), mx.prepare_fp8(qw), XLA),
                         (prepare_decode(qa), prepare_decode(qw), mx.Recipe(backend="fp8")),
                         (mx.prepare_fp8(qa), prepare_decode(qw), mx.Recipe(backend="fp8")),
                         (prepare_decode(qa), prepare_decode(qw), mx.Recipe(backend="pallas"))):
        # each backend against itself on the MXFP4Arrays (fp8 sums in another order than xla)
        want = np.asarray(mx.dot_general(qa, qw, dn, recipe=recipe))
        np.testing.assert_array_equal(np.asarray(mx.dot_general(a, b, dn, recipe=recipe)), want,
                                      err_msg=f"{type(a).__name__} x {type(b).__name__}, {recipe.backend}")
        np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_rotated_weight_rotates_the_float_operand_the_same_way(rng):
    w = jnp.asarray(rng.standard_normal((128, 32)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    from jax_mxfp4.hadamard import random_hadamard_transform

    q = dataclasses.replace(mx.quantize(random_hadamard_transform(w, 0, 3, 32), 0), hadamard=(32, 3))
    dn = (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(np.asarray(mx.dot_general(x, prepare_decode(q), dn, recipe=XLA)),
                                  np.asarray(mx.dot_general(x, q, dn, recipe=XLA)))


def test_dense_takes_a_prepared_kernel(rng):
    x = jnp.asarray(rng.standard_normal((5, 70)), jnp.bfloat16)  # K = 70: padded to 96
    q = mx.quantize(jnp.pad(jnp.asarray(rng.standard_normal((70, 24)), jnp.float32), ((0, 26), (0, 0))), 0)
    got = mx.dense(x, prepare_decode(q), recipe=XLA)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(mx.dense(x, q, recipe=XLA), np.float32))


# ------------------------------------------------------------------ pytree, jit, sharding, orbax
def test_pytree_jit_sharding_and_orbax(tmp_path, rng):
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    q, _, _ = mk(rng, (128, 64), 0)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    p = prepare_decode(q)
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 2
    r = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(r, DecodePrepared) and (r.shape, r.axis) == (p.shape, p.axis)
    dn = (((1,), (0,)), ((), ()))
    f = jax.jit(lambda x, p: mx.dot_general(x, p, dn, recipe=XLA))
    want = np.asarray(mx.dot_general(x, q, dn, recipe=XLA))
    np.testing.assert_array_equal(np.asarray(f(x, p)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: p)(p).to_mxfp4().data), np.asarray(q.data))
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    ps = DecodePrepared(jax.device_put(p.data, NamedSharding(mesh, P("model", None))),  # N over 8 devices
                        jax.device_put(p.scales, NamedSharding(mesh, P(None, "model"))), p.axis, p.shape, p.dtype)
    assert ps.data.sharding.spec[0] == "model" and ps.scales.sharding.spec[1] == "model"
    col = NamedSharding(mesh, P(None, "model"))  # the MXFP4Array [K, N] sharded the same way (N)
    qs = mx.MXFP4Array(jax.device_put(q.data, col), jax.device_put(q.scales, col), 0, q.shape, q.dtype)
    got = np.asarray(f(x, ps))  # XLA's CPU dot may sum a sharded GEMM in another order than the whole
    np.testing.assert_array_equal(got, np.asarray(f(x, qs)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "p", {"w": p})
    ckpt.wait_until_finished()
    back = ckpt.restore(tmp_path / "p", {"w": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p)})["w"]
    assert isinstance(back, DecodePrepared) and back.shape == p.shape
    np.testing.assert_array_equal(u8(back.data), u8(p.data))
    np.testing.assert_array_equal(u8(back.scales), u8(p.scales))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", ["Pairs", "", None, 1, b"pairs", ["pairs"], np.array(["pairs", "natural"])])
def test_unknown_byte_order_is_a_value_error(bad):
    """prepare_decode and DecodePrepared name a byte order outside ("natural", "lanes"); a NumPy
    array of names raised NumPy's "truth value of an array ... is ambiguous" instead."""
    rng = np.random.default_rng(0)
    q, _, _ = mk(rng, (64, 64), 0)
    p = prepare_decode(q, "natural")
    with pytest.raises(ValueError, match=r"prepare_decode: byte_order must be one of \('natural', 'lanes'\)"):
        prepare_decode(q, byte_order=bad)
    with pytest.raises(ValueError, match=r"DecodePrepared byte_order must be one of \('natural', 'lanes'\)"):
        DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.float32, byte_order=bad)
    assert DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.float32, byte_order="natural").byte_order == "natural"


def test_removed_pairs_byte_order_names_lanes_as_its_replacement(rng):
    """The former "pairs" order (measured slower than "lanes") is refused by prepare_decode and by
    DecodePrepared (e.g. one restored from a record written with it), the message naming the
    allowed orders and "lanes" as the replacement."""
    q, _, _ = mk(rng, (64, 64), 0)
    p = prepare_decode(q)
    msg = r"byte_order must be one of \('natural', 'lanes'\), got 'pairs' \(removed: \"lanes\" replaces it"
    with pytest.raises(ValueError, match="prepare_decode: " + msg):
        prepare_decode(q, byte_order="pairs")
    with pytest.raises(ValueError, match="DecodePrepared " + msg):
        DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.float32, byte_order="pairs")


def test_bad_input_is_named(tmp_path, rng):
    q, _, _ = mk(rng, (64, 64), 0)
    p = prepare_decode(q)
    with pytest.raises(TypeError, match="prepare_decode takes an MXFP4Array, got ArrayImpl .*quantize"):
        prepare_decode(jnp.ones((64, 4)))
    with pytest.raises(TypeError, match="prepare_decode takes an MXFP4Array, got FP8Prepared .*to_mxfp4"):
        prepare_decode(mx.prepare_fp8(q))
    with pytest.raises(TypeError, match="got DecodePrepared"):
        prepare_decode(p)
    with pytest.raises(ValueError, match=r"DecodePrepared.data must be uint8 of shape \(64, 32\)"):
        DecodePrepared(p.data.astype(jnp.int8), p.scales, 0, (64, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"DecodePrepared.scales must be float8_e8m0fnu of shape \(2, 64\)"):
        DecodePrepared(p.data, jnp.swapaxes(p.scales, 0, 1), 0, (64, 64), jnp.float32)  # plain, not K-major
    with pytest.raises(ValueError, match="DecodePrepared.scales must be float8_e8m0fnu"):
        DecodePrepared(p.data, p.scales.view(jnp.uint8), 0, (64, 64), jnp.float32)
    with pytest.raises(ValueError, match="DecodePrepared axis must be an int in"):
        DecodePrepared(p.data, p.scales, 2, (64, 64), jnp.float32)
    with pytest.raises(ValueError, match="not a multiple of the MXFP4 block size"):
        DecodePrepared(p.data, p.scales, 0, (48, 64), jnp.float32)
    with pytest.raises(TypeError, match="DecodePrepared dtype"):
        DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.int32)
    with pytest.raises(ValueError, match="DecodePrepared scale_mode"):
        DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.float32, "round")
    with pytest.raises(ValueError, match="hadamard"):
        DecodePrepared(p.data, p.scales, 0, (64, 64), jnp.float32, hadamard=(32, -1))
    with pytest.raises(ValueError, match="DecodePrepared array quantized along axis 0, but its contracting dims"):
        mx.dot_general(jnp.ones((4, 64)), p, (((1,), (1,)), ((), ())), recipe=XLA)
    with pytest.raises(ValueError, match="contracted along it alone"):
        canonical(p, (1,), ())
    stacked = jax.vmap(prepare_decode)(mx.quantize(jnp.ones((3, 64, 8)), 1))  # children batched, static shape not
    with pytest.raises(ValueError, match="batching a DecodePrepared with vmap/scan is not supported"):
        stacked.to_mxfp4()
    with pytest.raises(TypeError, match="DecodePrepared holds packed E2M1 codes"):
        np.asarray(p)
    with pytest.raises(TypeError, match="DecodePrepared holds packed E2M1 codes"):
        jnp.asarray(p)
    with pytest.raises(TypeError, match="a prepared weight, DecodePrepared: use q.dequantize"):
        mx.dequantize(p)
    with pytest.raises(TypeError, match=r"is a prepared weight \(DecodePrepared\); save t.to_mxfp4"):
        checkpoint.save_mxfp4(tmp_path / "w.safetensors", {"w": p})
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="gradient with respect to rhs"):
        jax.grad(lambda p_: mx.dot_general(x, p_, (((1,), (0,)), ((), ()))).sum(), allow_int=True)(p)
    g = jax.grad(lambda x_: mx.dot_general(x_, p, (((1,), (0,)), ((), ())), recipe=XLA).sum())(x)
    assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()


# ------------------------------------------------------------------ the CUDA route (lowered here)
def _lower_w4a16_for_cuda(w, xshape, dn):
    leaves, tree = jax.tree_util.tree_flatten(w)
    rec = mx.Recipe(quantize_activations=False)
    f = jax.jit(lambda x, *l: mx.dot_general(x, jax.tree_util.tree_unflatten(tree, l), dn, recipe=rec))
    return f.trace(jax.ShapeDtypeStruct(xshape, jnp.bfloat16), *leaves).lower(lowering_platforms=("cuda",)).as_text()


def _transposed_weight_bytes(txt, nbytes):
    """stablehlo.transpose ops on ui8 / E8M0 tensors of ``nbytes`` elements (the packed weight)."""
    hits = []
    for line in txt.splitlines():
        m = re.search(r"stablehlo\.transpose .*: \(tensor<([0-9x]+)x(ui8|f8E8M0FNU)>\)", line)
        if m and int(np.prod([int(d) for d in m.group(1).split("x")])) in nbytes:
            hits.append(line.strip())
    return hits


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("wshape,axis,xshape,dn", [
    ((2048, 1024), 0, (16, 2048), (((1,), (0,)), ((), ()))),  # Flax kernel layout [K, N]
    ((2, 2048, 1024), 1, (2, 16, 2048), (((2,), (1,)), ((0,), (0,)))),  # stacked [L, K, N]
])
def test_cuda_dispatch_route_reads_the_prepared_weight_without_transposes(monkeypatch, wshape, axis, xshape, dn):
    from jax_mxfp4.backends import fp8, pallas

    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    q = mx.quantize(jnp.ones(wshape, jnp.float32), axis)
    p = prepare_decode(q)
    sizes = {int(np.prod(q.data.shape)), int(np.prod(q.scales.shape))}
    plain_txt = _lower_w4a16_for_cuda(q, xshape, dn)
    prep_txt = _lower_w4a16_for_cuda(p, xshape, dn)
    assert "mosaic_gpu" in plain_txt and "mosaic_gpu" in prep_txt
    plain_hits = _transposed_weight_bytes(plain_txt, sizes)
    assert any("ui8" in h for h in plain_hits), plain_hits  # the plain [K, N] weight: its bytes moved per call
    assert _transposed_weight_bytes(prep_txt, sizes) == []
    # explain() says so (the decision for a CUDA process: the problem as dispatch builds it there)
    from jax_mxfp4 import dispatch, gemm

    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    x = jax.ShapeDtypeStruct(xshape, jnp.bfloat16)
    rec = mx.Recipe(backend="pallas", quantize_activations=False)
    assert "read as stored, no per-call conversion" in str(gemm.explain(x, p, dn, recipe=rec))
    assert "per call, and the packed data too unless the weight is stored K-last" in str(gemm.explain(x, q, dn, recipe=rec))


@pytest.mark.sweep(keep=1)
# ------------------------------------------------------------------ the partitioning rule (K-major scales)
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("style", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["tp-column", "tp-row"])
def test_prepared_weight_through_the_partitioning_rule(monkeypatch, style, layout, rng):
    """The pallas backend handed the DecodePrepared itself (as on the Mosaic GPU route; here its
    interpreter route, which converts inside the shard): the custom_partitioning rule shards the
    K-major scales [B, K/32, N] with the data [B, N, K/2] - no all-gather, tp-row one all-reduce."""
    import jax_mxfp4.backends.pallas as pallas_mod
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    monkeypatch.setattr(pallas_mod.PallasBackend, "takes_decode_prepared",
                        lambda self, problem: (problem.lhs_decode_prepared, problem.rhs_decode_prepared))
    q, codes, sb = mk(rng, (256, 128), 0)
    p = prepare_decode(q)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    fwd = lambda a, b: mx.dot_general(a, b, dn, preferred_element_type=jnp.float32, recipe=W4A16_PALLAS)  # noqa: E731
    single = np.asarray(jax.jit(fwd)(x, q))
    mesh = (jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2) if style == "auto"
            else jax.make_mesh((2, 4), ("data", "model")))
    if layout == "tp-column":  # N over "model"
        xs, ds, ss = P("data", None), P("model", None), P(None, "model")
    else:  # K over "model": data [N, K/2] and scales [K/32, N] split along K
        xs, ds, ss = P("data", "model"), P(None, "model"), P("model", None)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, xs))
        pp = DecodePrepared(jax.device_put(p.data, NamedSharding(mesh, ds)),
                            jax.device_put(p.scales, NamedSharding(mesh, ss)), p.axis, p.shape, p.dtype)
        f = jax.jit(fwd)
        out = np.asarray(f(xx, pp))
        text = f.lower(xx, pp).compile().as_text()
    assert not re.search(r"\ball-gather(-start)?\(", text)
    assert bool(re.search(r"\ball-reduce(-start)?\(", text)) == (layout == "tp-row")
    if layout == "tp-row":  # partial sums in another order
        mag = np.abs(np.asarray(x, np.float64)) @ np.abs(dequantize_ref(codes, sb, 0))
        assert (np.abs(out - single) <= 256 * 2.0**-24 * mag).all()
    else:
        np.testing.assert_array_equal(out, single)


def test_explain_and_batched_prepared_operands_raise_like_dot_general(rng):
    """explain() raises what dot_general raises for a quantized operand contracted along a
    non-quantized axis (it used to pick a backend); a prepared operand batched by vmap/scan is
    named as such by dot_general and dense (it used to read as a contracting-shape mismatch or
    "kernel must be 2-D")."""
    q, _, _ = mk(rng, (64, 64), 0)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    wrong = (((1,), (1,)), ((), ()))  # rhs contracted along dim 1, quantized along 0
    for w, what in ((q, "an MXFP4Array"), (prepare_decode(q), "a DecodePrepared array"),
                    (mx.prepare_fp8(q), "an FP8Prepared array")):
        for f in (mx.explain, mx.dot_general):
            with pytest.raises(ValueError, match=f"rhs is {what} quantized along axis 0, but its contracting dims "
                                                 r"are \(1,\): an MXFP4 operand must be quantized along its single"):
                f(x, w, wrong)
    stacked, codes, sb = mk(rng, (3, 64, 32), 1)
    dn = (((0,), (0,)), ((), ()))
    for prep, name in ((prepare_decode, "DecodePrepared"), (mx.prepare_fp8, "FP8Prepared")):
        p3 = prep(stacked)
        with pytest.raises(ValueError, match=f"batching an? {name} with vmap/scan is not supported"):
            jax.vmap(lambda b: mx.dot_general(x[0], b, dn))(p3)
        with pytest.raises(ValueError, match=f"batching an? {name} with vmap/scan is not supported"):
            jax.lax.scan(lambda c, b: (c, mx.dot_general(x[0], b, dn)), 0, p3)
        with pytest.raises(ValueError, match=f"batching an? {name} with vmap/scan is not supported"):
            jax.vmap(lambda b: mx.dense(x, b))(p3)
    # the supported form of the same products: the stacked weight with dot_general's batch dims,
    # against the float64 reference (x[0] quantized along K, times each layer's weight)
    xb = jnp.broadcast_to(x[0], (3, 64))
    got = mx.dot_general(xb, prepare_decode(stacked), (((1,), (1,)), ((0,), (0,))), recipe=XLA,
                         preferred_element_type=jnp.float32)
    ref = np.einsum("k,lkn->ln", qdq(np.asarray(x[0], np.float64), 0), dequantize_ref(codes, sb, 1))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_children_sharded_along_different_dims_are_named(rng):
    """Under an explicit mesh, scales sharded otherwise than the data (e.g. one spec given to both
    children, as jax.device_put(prepared, sharding) does) failed deep in JAX (DuplicateSpecError,
    ShardingTypeError); now a ValueError with the spec to use. Consistent shardings (K-major
    scales spec = data spec with the last two entries swapped) and replicated scales give the
    float64 reference product."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    q, codes, sb = mk(rng, (256, 64), 0)
    p = prepare_decode(q)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    ref = qdq(np.asarray(x), 1) @ dequantize_ref(codes, sb, 0)
    dn = (((1,), (0,)), ((), ()))
    mesh = jax.make_mesh((4,), ("m",), axis_types=(jax.sharding.AxisType.Explicit,))

    def put(dspec, sspec):
        return DecodePrepared(jax.device_put(p.data, NamedSharding(mesh, dspec)),
                              jax.device_put(p.scales, NamedSharding(mesh, sspec)), 0, p.shape, p.dtype)

    with jax.set_mesh(mesh):
        f = jax.jit(lambda a, b: mx.dot_general(a, b, dn, recipe=XLA))
        for dspec, sspec in ((P("m", None), P(None, "m")), (P(None, "m"), P("m", None)), (P("m", None), P(None, None))):
            got = np.asarray(f(x, put(dspec, sspec)), np.float64)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for dspec, sspec, want in ((P("m", None), P("m", None), r"P\(None, 'm'\)"),
                                   (P(None, None), P(None, "m"), r"P\(None, None\)")):
            with pytest.raises(ValueError, match=r"DecodePrepared.scales are sharded .* must be sharded as the data "
                                                 rf".* swapped, {want}, or replicated"):
                f(x, put(dspec, sspec))
            with pytest.raises(ValueError, match="DecodePrepared.scales are sharded"):
                jax.jit(lambda b: b.to_mxfp4().dequantize())(put(dspec, sspec))


def test_lanes_order_bytes_round_trip_and_refusal(rng):
    """lanes_order_bytes and its inverse undo each other on fresh random bytes (NumPy and jnp give
    the same bytes); a last axis that is not whole 32-bit words is a ValueError naming the rule."""
    from jax_mxfp4.decode_prepared import lanes_order_bytes

    b = rng.integers(0, 256, (3, 5, 64), dtype=np.uint8)
    fwd = lanes_order_bytes(b)
    np.testing.assert_array_equal(fwd, lanes_ref(b))
    np.testing.assert_array_equal(np.asarray(lanes_order_bytes(jnp.asarray(b))), fwd)
    np.testing.assert_array_equal(lanes_order_bytes(fwd, inverse=True), b)
    np.testing.assert_array_equal(pairs_from_lanes_ref(fwd), b)
    with pytest.raises(ValueError, match="not whole 32-bit words"):
        lanes_order_bytes(np.zeros((4, 6), np.uint8))


@pytest.mark.parametrize("data,kw,err,msg", [
    (np.arange(8, dtype=np.int32), {}, TypeError, "must be uint8"),
    (np.array([-1, 2, 3, 4], np.int8), {}, TypeError, "must be uint8"),
    (np.zeros(8, np.float32), {}, TypeError, "must be uint8"),
    (np.uint8(3), {}, ValueError, "at least one axis"),
    ([1, 2, 3, 4], {}, TypeError, "must be a NumPy or jax array"),
    (None, {}, TypeError, "must be a NumPy or jax array"),
    (np.zeros(8, np.uint8), {"inverse": "no"}, TypeError, "inverse must be a bool"),
])
def test_lanes_order_bytes_bad_input_is_named(data, kw, err, msg):
    """Bad input is refused with the function's name and the rule: wider integers (they lost their
    high bits silently), 0-d arrays and lists, and an ``inverse`` that is not a bool."""
    from jax_mxfp4.decode_prepared import lanes_order_bytes

    with pytest.raises(err, match=f"lanes_order_bytes: .*{msg}"):
        lanes_order_bytes(data, **kw)


def test_pair_order_bytes_bad_input_is_named():
    with pytest.raises(ValueError, match="pair_order_bytes: data must have at least one axis"):
        pair_order_bytes(np.uint8(3))
    with pytest.raises(TypeError, match="pair_order_bytes: data must be a NumPy or jax array"):
        pair_order_bytes(list(range(16)))
