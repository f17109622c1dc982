"""The Pallas MXFP4 -> FP8-operand kernel (jax_mxfp4.kernels.fp8_encode) against the jnp rules.

Independent reference for the byte steps: ml_dtypes' float8_e4m3fn / float8_e5m2 conversion of
E2M1 x 2^d in float64. The whole kernel is compared bit for bit with jax_mxfp4.fp8_prepared.encode_rows (whose rules are
tested against float64 in tests/test_fp8.py) in the Pallas interpreter.
"""

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jax_mxfp4.fp8_prepared import encode_rows, encode_rows_on
from jax_mxfp4.kernels.fp8_encode import encode_rows_kernel

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


# (byte step, ml_dtypes type, d_min, d_max, first d of the normal-only form)
WORDS = {"e4m3": ("e4m3_word", ml_dtypes.float8_e4m3fn, -8, 6, -5),
         "e5m2": ("e5m2_word", ml_dtypes.float8_e5m2, -15, 13, -13)}


@pytest.mark.parametrize("fmt", sorted(WORDS))
@pytest.mark.parametrize("normal_only", [False, True])
def test_word_every_code_and_shift(fmt, normal_only, rng):
    """The word-parallel byte steps (four codes per uint32) against ml_dtypes for every code in
    every byte position and every shift d of the format's window (normal_only: from the first d
    where it is documented to hold: -5 for E4M3, -13 for E5M2; the subnormal bytes are below)."""
    from jax_mxfp4.kernels import fp8_encode

    name, ml_type, d_min, d_max, d_normal = WORDS[fmt]
    word = getattr(fp8_encode, name)
    for d in range(d_normal if normal_only else d_min, d_max + 1):
        codes = np.concatenate([np.stack([np.roll(np.arange(16), j) for j in range(4)], 1),  # each code in each byte
                                rng.integers(0, 16, (512, 4))])
        y = (codes[:, 0] | codes[:, 1] << 8 | codes[:, 2] << 16 | codes[:, 3] << 24).astype(np.uint32)
        got = np.asarray(word(jnp.asarray(y), jnp.full(y.shape, d - d_min, jnp.int32), normal_only))
        val = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7] * 2.0 ** d
        want = val.astype(ml_type).view(np.uint8)
        np.testing.assert_array_equal(got.view(np.uint8).reshape(-1, 4), want, err_msg=f"d={d}")


def test_spread_nibbles_is_element_order(rng):
    from jax_mxfp4.kernels.fp8_encode import spread_nibbles

    x = rng.integers(0, 65536, 4096).astype(np.uint32)
    b = x.astype(np.uint16).view(np.uint8).reshape(-1, 2)
    want = np.stack([b[:, 0] & 15, b[:, 0] >> 4, b[:, 1] & 15, b[:, 1] >> 4], 1)
    np.testing.assert_array_equal(np.asarray(spread_nibbles(jnp.asarray(x))).view(np.uint8).reshape(-1, 4), want)


# per format: a band of scale bytes flagging most rows, and one keeping most rows inside the window
BANDS = {"e4m3": ((100, 150), (120, 135)), "e5m2": ((80, 170), (113, 142))}


@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("fmt,band", [(f, b) for f in sorted(BANDS) for b in BANDS[f]])
@pytest.mark.parametrize("rows,k,rpp,chunk", [(13, 1024, 8, 32), (7, 16384, 1, 256), (5, 96, 4, 32), (33, 1280, 8, 4)])
def test_kernel_matches_encode_rows_across_the_window(rows, k, rpp, chunk, fmt, band, rng):
    """The word-parallel kernel equals the jnp rule bit for bit, in both formats. The narrow band
    keeps most rows inside the window (15 binades for E4M3, 29 for E5M2), so blocks near the
    bottom of their row's window take the subnormal FP8 cases (E4M3 d = -8..-6, E5M2 d = -15..-14);
    edge rows: a block outside the window, NaN, 0x00 over codes 1 (flushed), 0xFE over codes 7
    (Inf), 0x01 over code 1, 0xFD over code 6, all-zero row."""
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    sb = rng.integers(*band, (rows, k // 32)).astype(np.uint8)
    nb = k // 32
    edges = [(0, nb - 1, 20, None), (1, 0, 255, None), (2, 0, 0, 0x11), (3, 0, 254, 0x77), (4, 0, 1, 0x01),
             (5, 0, 253, 0x60)]
    for r, blk, byte, fill in edges[:rows]:
        sb[r, blk] = byte
        if fill is not None:
            data[r, blk * 16:(blk + 1) * 16] = fill
    if rows > 6:
        data[6] = 0
    want = encode_rows(jnp.asarray(data), jnp.asarray(sb), fmt)
    if band == BANDS[fmt][1] and rows > 7:  # the low shifts are really there in rows that are not flagged
        assert (np.asarray(want[2])[7:] & 1 == 0).any()
    got = encode_rows_kernel(jnp.asarray(data), jnp.asarray(sb), rows_per_program=rpp, chunk_blocks=chunk,
                             interpret=True, fmt=fmt)
    for w, g, name in zip(want, got, ("codes", "row_exp", "row_flag")):
        np.testing.assert_array_equal(_as_bytes(g), _as_bytes(w), err_msg=name)
    flags = np.asarray(want[2])
    assert all(flags[r] & 1 for r in (0, 2, 3, 4, 5) if r < rows) and (rows < 2 or flags[1] & 2)


def test_kernel_lowers_for_cuda():
    """The default tile and a multi-row one with ragged rows lower through Triton on a CPU machine,
    in both formats."""
    for rows, kw in ((64, {}), (33, dict(rows_per_program=8, chunk_blocks=32, num_warps=4)), (64, dict(fmt="e5m2"))):
        f = jax.jit(lambda d, s, kw=kw: encode_rows_kernel(d, s, **kw))
        txt = f.trace(jax.ShapeDtypeStruct((rows, 4096), jnp.uint8), jax.ShapeDtypeStruct((rows, 256), jnp.uint8)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mxfp4_encode_fp8_rows" in txt


def test_kernel_names_bad_containers_and_takes_numpy_tiles(rng):
    """A list or None is named (was an AttributeError on .ndim); numpy ints are tile sizes like
    ints; ``interpret`` must be a bool; spread_nibbles takes a uint16 without losing its high byte."""
    from jax_mxfp4.kernels.fp8_encode import spread_nibbles

    s = jnp.zeros((1, 1), jnp.uint8)
    with pytest.raises(TypeError, match="data must be uint8"):
        encode_rows_kernel([[1] * 16], s, interpret=True)
    with pytest.raises(TypeError, match="scale_bytes: scales must be"):
        encode_rows_kernel(jnp.zeros((1, 16), jnp.uint8), [[127]], interpret=True)
    with pytest.raises(TypeError, match="interpret must be a bool"):
        encode_rows_kernel(jnp.zeros((1, 16), jnp.uint8), s, interpret="yes")
    data = jnp.asarray(rng.integers(0, 256, (4, 16), dtype=np.uint8))
    sb = jnp.asarray(rng.integers(120, 130, (4, 1)).astype(np.uint8))
    got = encode_rows_kernel(data, sb, rows_per_program=np.int64(2), num_warps=np.int32(4), interpret=True)
    np.testing.assert_array_equal(_as_bytes(got[0]), _as_bytes(encode_rows(data, sb)[0]))
    assert int(spread_nibbles(jnp.uint16(0xABCD))) == 0x0A0B0C0D


def _as_bytes(v):
    v = np.asarray(v)
    return v.view(np.uint8) if v.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2) else v


@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("chunk", [256, 32, 4])  # one step for K <= 8192, 32 blocks, many steps
@pytest.mark.parametrize("rows,k,rpp", [(8, 64, 8), (13, 1024, 8), (33, 96, 4), (5, 1280, 8), (1, 32, 8)])
def test_kernel_matches_encode_rows(rows, k, rpp, chunk, rng):
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    sb = rng.integers(100, 150, (rows, k // 32)).astype(np.uint8)
    edge = {  # row -> what it exercises
        0: "block 20 binades below the row maximum (outside the window: exact flag)",
        1: "NaN scale byte 0xFF",
        2: "scale byte 0x00 (flushed elements: exact flag)",
        3: "scale byte 0xFE (overflow to Inf: exact flag)",
        4: "all-zero row",
        5: "all-zero block with a far scale (not counted)",
    }
    nb = k // 32
    for r in range(min(rows, len(edge))):
        if r == 0:
            sb[0, :] = 130
            sb[0, nb - 1] = 110
            data[0, -16:] |= 0x11  # nonzero codes in the far block
        elif r == 1:
            sb[1, nb // 2] = 255
        elif r == 2:
            sb[2, 0] = 0
            data[2, :16] = 0x11
        elif r == 3:
            sb[3, 0] = 254
            data[3, :16] = 0x77
        elif r == 4:
            data[4, :] = 0
        elif r == 5:
            data[5, :16] = 0
            sb[5, 0] = 10
    want = encode_rows(jnp.asarray(data), jnp.asarray(sb))
    got = encode_rows_kernel(jnp.asarray(data), jnp.asarray(sb), rows_per_program=rpp, chunk_blocks=chunk,
                             interpret=True)
    for w, g, name in zip(want, got, ("codes", "row_exp", "row_flag")):
        np.testing.assert_array_equal(_as_bytes(g), _as_bytes(w), err_msg=name)
    if rows > 3 and nb > 1:
        assert np.asarray(want[2])[[0, 2, 3]].tolist() == [1, 1, 1]  # the edge rows really are flagged
        assert np.asarray(want[2])[1] & 2


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("rows,k", [(7, 16384), (3, 96), (6, 8192)])  # two whole-row steps, one short, one
def test_default_tile_matches_encode_rows(rows, k, rng):
    """The default tile, which encode_rows_on runs on CUDA (one row per program, 256-block steps),
    equals the jnp rule bit for bit, edge rows included (a block outside the window, NaN, 0x00 and
    0xFE scale bytes)."""
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    sb = rng.integers(100, 150, (rows, k // 32)).astype(np.uint8)
    sb[0, -1] = 60  # far below the row maximum: flagged
    sb[1, 0] = 255
    sb[2, 0], data[2, :16] = 0, 0x11
    want = encode_rows(jnp.asarray(data), jnp.asarray(sb))
    got = encode_rows_kernel(jnp.asarray(data), jnp.asarray(sb), interpret=True)
    for w, g, name in zip(want, got, ("codes", "row_exp", "row_flag")):
        np.testing.assert_array_equal(_as_bytes(g), _as_bytes(w), err_msg=name)
    assert np.asarray(want[2])[0] & 1 and np.asarray(want[2])[1] & 2


def test_encode_rows_on_cpu_is_the_jnp_form(rng):
    data = jnp.asarray(rng.integers(0, 256, (2, 3, 32), dtype=np.uint8))
    sb = jnp.asarray(rng.integers(120, 135, (2, 3, 2)).astype(np.uint8))
    for w, g in zip(encode_rows(data, sb), encode_rows_on(data, sb, "cpu")):
        np.testing.assert_array_equal(_as_bytes(g), _as_bytes(w))


def test_kernel_rejects_bad_shapes():
    with pytest.raises(ValueError, match="scale_bytes"):
        encode_rows_kernel(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 2), jnp.uint8), interpret=True)



@pytest.mark.parametrize("kw", [dict(num_warps=3), dict(num_warps=0), dict(num_warps="4"), dict(num_warps=True),
                                dict(rows_per_program=3), dict(chunk_blocks=0)])
def test_kernel_rejects_bad_tiling(kw):
    """Tile and warp counts are checked by name on every platform (num_warps=3 or "4" went
    through in the interpreter, which ignores it, and would fail only in Triton on a GPU)."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be a power of two"):
        encode_rows_kernel(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 1), jnp.uint8), interpret=True, **kw)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_kernel_rejects_a_non_bool_interpret(bad):
    with pytest.raises(TypeError, match="interpret must be a bool"):
        encode_rows_kernel(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 1), jnp.uint8), interpret=bad)


def test_scales_as_e8m0_are_read_as_bytes(rng):
    """float8_e8m0fnu scales are bit-cast, not converted by value (a value cast would give 2^b-127)."""
    data = jnp.asarray(rng.integers(0, 256, (4, 32), dtype=np.uint8))
    sb = rng.integers(100, 140, (4, 2)).astype(np.uint8)
    from jax import lax

    e8 = lax.bitcast_convert_type(jnp.asarray(sb), jnp.float8_e8m0fnu)
    want = encode_rows(data, jnp.asarray(sb))
    for got in (encode_rows_kernel(data, e8, interpret=True), encode_rows_on(data, e8, "cpu")):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(_as_bytes(g), _as_bytes(w))


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_bad_operands_rejected_on_every_platform(platform):
    d, s = jnp.zeros((4, 32), jnp.uint8), jnp.zeros((4, 2), jnp.uint8)
    with pytest.raises(ValueError, match="scale_bytes"):
        encode_rows_on(d, s[:, :1], platform)  # one scale for two blocks
    with pytest.raises(ValueError, match="scale_bytes"):
        encode_rows_on(d[:3], s, platform)  # row counts differ
    with pytest.raises(ValueError, match="K % 32"):
        encode_rows_on(jnp.zeros((4, 12), jnp.uint8), jnp.zeros((4, 0), jnp.uint8), platform)
    with pytest.raises(TypeError, match="data must be uint8"):
        encode_rows_on(d.astype(jnp.float32), s, platform)
    with pytest.raises(TypeError, match="scales must be"):
        encode_rows_on(d, s.astype(jnp.int32), platform)


def test_kernel_empty_input_and_bad_rows_per_program():
    d, s = jnp.zeros((0, 32), jnp.uint8), jnp.zeros((0, 2), jnp.uint8)
    codes, row_exp, row_flag = encode_rows_kernel(d, s, interpret=True)
    assert codes.shape == (0, 64) and row_exp.shape == (0,) and row_flag.shape == (0,)
    with pytest.raises(ValueError, match="rows_per_program"):
        encode_rows_kernel(jnp.zeros((4, 32), jnp.uint8), jnp.zeros((4, 2), jnp.uint8), rows_per_program=0,
                           interpret=True)
