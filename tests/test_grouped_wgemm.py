"""The grouped weight-stationary kernel (jax_mxfp4.kernels.grouped_wgemm) in the Pallas
interpreter, against a NumPy float64 reference of the ragged product: each group's bfloat16 rows
times its expert's exactly decoded MXFP4 values (tests/mx_reference.py), rows past the groups zero.

Edge cases named: empty groups (most experts unused at decode sizes), a group holding every row,
a group spanning several row passes (more rows than ``bm``), K not a multiple of the K step
(K = 2880 as in gpt-oss, masked), split-K, both expert storages ([G, N, K] and [G, K, N]), N not a
multiple of the N tile, rows past sum(group_sizes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from jax_mxfp4 import ragged
from jax_mxfp4.backends import grouped
from jax_mxfp4.kernels.grouped_wgemm import GroupedConfig, default_grouped_config, grouped_weight_gemm, slots
from jax_mxfp4.mx_format import as_scale_bytes

from mx_reference import bf16


def _experts(rng, g, k, n, k_axis):
    shape = (g, n, k) if k_axis == 2 else (g, k, n)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-3, 4, (g, 1, 1)))
    q = mx.quantize(jnp.asarray(w), k_axis)
    return q, np.asarray(mx.dequantize(q, jnp.float32), np.float64)


def _reference(x, w_dec, gs, k_axis):
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], w_dec.shape[3 - k_axis]))
    start = 0
    for g, s in enumerate(gs):
        wg = w_dec[g] if k_axis == 1 else w_dec[g].T  # [K, N]
        out[start:start + s] = x[start:start + s] @ wg
        start += s
    return out


CASES = [
    # (M, K, N, group sizes, k_axis, cfg overrides)
    pytest.param(4, 256, 160, [0, 1, 0, 0, 2, 0, 1, 0], 2, {}, id="decode-empty-groups-nk"),
    pytest.param(4, 256, 160, [0, 1, 0, 0, 2, 0, 1, 0], 1, {}, id="decode-empty-groups-kn"),
    pytest.param(40, 2880, 64, [0, 37, 0], 2, dict(bm=16, bn=32), id="k2880-masked-three-row-passes-nk"),
    pytest.param(40, 2880, 64, [3, 0, 30], 1, dict(bm=16, bn=32, split_k=4), id="k2880-masked-split4-kn"),
    pytest.param(24, 512, 48, [24, 0], 2, dict(split_k=2, bn=32), id="one-group-all-rows-split2-nk"),
    pytest.param(24, 512, 48, [5, 9], 1, dict(bn=32), id="rows-past-the-groups-are-zero-kn"),
]


@pytest.mark.parametrize("m,k,n,gs,k_axis,over", CASES)
def test_grouped_kernel_matches_float64_reference(rng, m, k, n, gs, k_axis, over):
    q, w_dec = _experts(rng, len(gs), k, n, k_axis)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    cfg = GroupedConfig(decode="f16", **over)
    got = grouped_weight_gemm(x, q.data, as_scale_bytes(q.plain_scales()), jnp.asarray(gs, jnp.int32),
                              k_axis=k_axis, out_dtype=jnp.float32, cfg=cfg, interpret=True)
    want = _reference(bf16(np.asarray(x, np.float32)), w_dec, gs, k_axis)
    assert got.shape == (m, n)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-6 * scale * np.sqrt(k / 256))
    assert not np.asarray(got)[sum(gs):].any()


def test_slots_list_the_nonempty_groups_in_order():
    table = np.asarray(slots(jnp.asarray([0, 3, 0, 2, 1, 0], jnp.int32), m=6))
    np.testing.assert_array_equal(table, [[1, 3, 4, 0, 0, 0], [0, 3, 5, 0, 0, 0], [3, 2, 1, 0, 0, 0]])
    # fewer rows than groups: min(M, G) slots, enough for every non-empty group
    table = np.asarray(slots(jnp.asarray([0, 0, 2, 0, 0, 1], jnp.int32), m=3))
    np.testing.assert_array_equal(table, [[2, 5, 0], [0, 2, 0], [2, 1, 0]])


def test_shapes_that_do_not_describe_the_product_are_refused():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    gs = jnp.asarray([2, 2], jnp.int32)
    cfg = GroupedConfig(decode="f16")
    with pytest.raises(ValueError, match="do not describe"):
        grouped_weight_gemm(x, jnp.zeros((2, 16, 16), jnp.uint8), jnp.zeros((2, 16, 2), jnp.uint8), gs,
                            k_axis=2, out_dtype=jnp.float32, cfg=cfg, interpret=True)
    with pytest.raises(ValueError, match="bfloat16"):
        grouped_weight_gemm(x.astype(jnp.float32), jnp.zeros((2, 16, 32), jnp.uint8), jnp.zeros((2, 16, 2), jnp.uint8),
                            gs, k_axis=2, out_dtype=jnp.float32, cfg=cfg, interpret=True)
    with pytest.raises(ValueError, match="split_k"):
        grouped_weight_gemm(x, jnp.zeros((2, 16, 32), jnp.uint8), jnp.zeros((2, 16, 2), jnp.uint8), gs, k_axis=2,
                            out_dtype=jnp.float32, cfg=GroupedConfig(decode="f16", split_k=2), interpret=True)


def test_default_config_splits_k_only_when_few_programs():
    decode = default_grouped_config(m=4, n=2880, k=2880, g=32, num_sms=132)  # 4 slots x 23 tiles, 23 K steps
    assert decode.bm == 16 and decode.split_k == 1  # 23 steps: no even split
    decode = default_grouped_config(m=4, n=2880, k=4096, g=32, num_sms=132)  # 32 K steps
    assert decode.split_k == 4
    busy = default_grouped_config(m=1024, n=5760, k=2880, g=32, num_sms=132)  # 32 slots x 45 tiles
    assert busy.bm == 32 and busy.split_k == 1


# ----------------------------------------------------------------------------- the ragged_dot route
@pytest.mark.parametrize("k_axis", [1, 2], ids=["experts-gkn", "experts-gnk"])
def test_grouped_product_equals_the_exact_route_a4w4_and_w4a16(rng, k_axis):
    gs = jnp.asarray([0, 3, 0, 5], jnp.int32)
    q, _ = _experts(rng, 4, 96, 48, k_axis)
    x = jnp.asarray(rng.standard_normal((10, 96)), jnp.bfloat16)
    dn = ragged._rows_dn(k_axis)
    for a in (x, mx.quantize(x, 1)):  # w4a16 and a4w4 (the activation decoded exactly to bfloat16)
        got = grouped.grouped_product(a, q, gs, k_axis, interpret=True)
        want = ragged._product_on(ragged.EXACT, a, q, gs, dn)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * float(jnp.abs(want).max()))


def test_explain_ragged_dot_takes_the_grouped_kernel_on_cuda_unless_kernels_are_off(monkeypatch):
    w = jax.ShapeDtypeStruct((32, 2880, 5760), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((32,), jnp.int32)
    decode = jax.ShapeDtypeStruct((64, 2880), jnp.bfloat16)
    assert ragged.explain_ragged_dot(decode, w, gs, platform="cuda").route == "grouped-kernel"
    assert ragged.explain_ragged_dot(decode, w, gs, platform="cpu").route == "exact"
    assert ragged.explain_ragged_dot(decode, w, gs, platform="rocm").route == "bf16-decode"
    big = jax.ShapeDtypeStruct((16384, 2880), jnp.bfloat16)  # 4096 tokens, top-4: every size takes the kernel
    assert ragged.explain_ragged_dot(big, w, gs, platform="cuda").route == "grouped-kernel"
    bf16 = mx.Recipe(fprop="bf16", dgrad="bf16", wgrad="bf16")
    assert ragged.explain_ragged_dot(decode, w, gs, recipe=bf16, platform="cuda").route == "bf16-decode"
    monkeypatch.setenv("JAX_MXFP4_KERNELS", "0")
    route = ragged.explain_ragged_dot(decode, w, gs, platform="cuda")
    assert route.route == "bf16-decode" and "JAX_MXFP4_KERNELS" in route.reason


def test_default_config_takes_128_row_passes_for_large_groups():
    cfg = default_grouped_config(m=16384, n=5760, k=2880, g=32, num_sms=132)  # 512 rows per expert
    assert (cfg.bm, cfg.num_warps, cfg.split_k) == (128, 8, 1)


@pytest.mark.parametrize("bad,match", [
    (dict(x=jnp.zeros((1, 4, 64), jnp.bfloat16)), "2-D"),
    (dict(w_data=jnp.zeros((2, 16, 32), jnp.float32)), "w_data must be uint8"),
    (dict(group_sizes=jnp.asarray([2.0, 2.0])), "integer"),
    (dict(out_dtype=jnp.int8), "out_dtype"),
], ids=["x-3d", "float-weights", "float-group-sizes", "int8-out"])
def test_kernel_arguments_of_the_wrong_kind_are_refused(bad, match):
    args = dict(x=jnp.zeros((4, 64), jnp.bfloat16), w_data=jnp.zeros((2, 16, 32), jnp.uint8),
                w_scales=jnp.zeros((2, 16, 2), jnp.uint8), group_sizes=jnp.asarray([2, 2], jnp.int32),
                out_dtype=jnp.float32)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        grouped_weight_gemm(args["x"], args["w_data"], args["w_scales"], args["group_sizes"], k_axis=2,
                            out_dtype=args["out_dtype"], cfg=GroupedConfig(decode="f16"), interpret=True)


@pytest.mark.parametrize("platform", ["CUDA", "gpu", "nvidia"])
def test_explain_ragged_dot_refuses_an_unknown_platform_name(platform):
    w = jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(ValueError, match="platform must be"):
        ragged.explain_ragged_dot(x, w, gs, platform=platform)


def test_slots_clip_invalid_sizes_to_the_rows_of_x():
    """Under jit invalid group sizes reach the kernel (the result is then made NaN by ragged_dot):
    the slot table must still keep every row inside 0 .. M-1."""
    table = np.asarray(slots(jnp.asarray([3, -2, 4, 5], jnp.int32), m=6))  # negative, and a sum of 12 > 6
    np.testing.assert_array_equal(table, [[0, 2, 0, 0], [0, 3, 0, 0], [3, 3, 0, 0]])
    assert (table[1] + table[2]).max() <= 6
