"""Weight-stationary MXFP4 kernel (w4a16 and decode-size a4w4): interpreter runs on CPU against a
float64 reference, and the inline-PTX E2M1 decode executed by a small PTX model in NumPy.

The PTX itself only runs on an NVIDIA GPU (tests/gpu/test_gpu_wgemm.py checks it there); here each
instruction of ``e2m1_asm._DECODE_PTX`` is executed on uint32 words with its PTX semantics
(byte permute, bf16x2 multiply rounded by ml_dtypes), so the bit manipulation and the output
positions are checked on every byte value and every E8M0 edge.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_mxfp4 as mx
from jax_mxfp4.kernels import e2m1_asm
from jax_mxfp4.kernels.wgemm import WTileConfig, default_wconfig, weight_stationary_gemm
from jax_mxfp4.mx_format import as_scale_bytes, e8m0_to_bf16_bits

# E2M1 code -> value, independently of the package: ml_dtypes' float4_e2m1fn (one code per byte)
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _bf16x2_mul(a, b):
    def lanes(w):
        return (np.array([w & 0xFFFF, w >> 16], np.uint16)).view(ml_dtypes.bfloat16).astype(np.float64)

    with np.errstate(over="ignore"):
        prod = (lanes(a) * lanes(b)).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    return int(prod[0] | (prod[1] << 16))


def _alu(op: str, a: list[int]) -> int:
    """One lane-local PTX instruction of the decode's subset on 32-bit words."""
    if op == "prmt.b32":  # bytes of {a (0-3), b (4-7)} picked by c's four selector nibbles
        pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
        r = 0
        for i in range(4):
            sel = (a[2] >> (4 * i)) & 0xF
            byte = pool[sel & 7]
            if sel & 8:  # sign-replicate mode
                byte = 0xFF if byte & 0x80 else 0
            r |= byte << (8 * i)
        return r
    ops = {
        "mul.lo.u32": lambda: (a[0] * a[1]) & 0xFFFFFFFF,
        "mov.b32": lambda: a[0],
        "mov.u32": lambda: a[0],
        "shl.b32": lambda: (a[0] << a[1]) & 0xFFFFFFFF,
        "shr.u32": lambda: a[0] >> a[1],
        "and.b32": lambda: a[0] & a[1],
        "or.b32": lambda: a[0] | a[1],
        "mul.rn.bf16x2": lambda: _bf16x2_mul(a[0], a[1]),
        "setp.ne.u32": lambda: int(a[0] != a[1]),  # predicates as 0/1
        "selp.b32": lambda: a[0] if a[2] else a[1],
    }
    if op not in ops:
        raise AssertionError(f"PTX model lacks {op}")
    return ops[op]()


def _instructions(asm: str):
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        yield op, dst, src


def _val(regs, tok):
    tok = tok.strip()
    return int(tok, 0) if re.match(r"^(0x[0-9a-fA-F]+|\d+)$", tok) else regs[tok]


def run_ptx(asm: str, inputs: dict[int, int]) -> dict[int, int]:
    """Execute the straight-line PTX subset used by the decode on 32-bit registers."""
    regs = {f"${i}": v for i, v in inputs.items()}
    for op, dst, src in _instructions(asm):
        regs[dst] = _alu(op, [_val(regs, t) for t in src])
    return regs


def run_ptx_warp(asm: str, inputs: list[dict[int, int]]) -> list[dict[int, int]]:
    """Execute ``asm`` in the 32 lanes of a warp in lockstep (``inputs[lane]``): the lane-local
    subset of :func:`run_ptx`, plus ``%laneid`` and ``shfl.sync.bfly.b32 d, a, lanemask, 0x1f,
    0xffffffff`` (d = register a of lane ^ lanemask; full warp, clamp 0x1f)."""
    assert len(inputs) == 32
    regs = [{f"${i}": v for i, v in lane_in.items()} | {"%laneid": lane} for lane, lane_in in enumerate(inputs)]
    for op, dst, src in _instructions(asm):
        if op == "shfl.sync.bfly.b32":
            reg, mask, clamp, members = src
            assert (int(clamp, 0), int(members, 0)) == (0x1F, 0xFFFFFFFF), (clamp, members)
            got = [regs[lane ^ int(mask, 0)][reg] for lane in range(32)]
            for lane in range(32):
                regs[lane][dst] = got[lane]
            continue
        for r in regs:
            r[dst] = _alu(op, [_val(r, t) for t in src])
    return regs


def _bf16_pair_values(word):
    return np.array([word & 0xFFFF, word >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 129, 200, 254, 255])
def test_asm_decode_every_byte_pattern(scale_byte):
    """All 256 byte values in every position of a 4-byte group, each scale rule edge: the PTX
    gives E2M1(nibble) x 2^(s-127) (NaN for 0xFF) in place, bit for bit (signs included)."""
    rng = np.random.default_rng(scale_byte)
    sbits = int(np.asarray(e8m0_to_bf16_bits(jnp.uint8(scale_byte))))
    scale_pair = sbits | (sbits << 16)
    words = [int(v) for v in rng.integers(0, 2**32, 64, dtype=np.uint64)]
    words += [b * 0x01010101 for b in range(256)]  # every byte value, in all four positions
    scale = np.float64(2.0) ** (scale_byte - 127)
    for q in words:
        regs = run_ptx(e2m1_asm._DECODE_PTX, {4: q, 5: scale_pair, 6: scale_pair})
        got_lo = np.concatenate([_bf16_pair_values(regs["$0"]), _bf16_pair_values(regs["$1"])])
        got_hi = np.concatenate([_bf16_pair_values(regs["$2"]), _bf16_pair_values(regs["$3"])])
        bytes_ = [(q >> (8 * j)) & 0xFF for j in range(4)]
        with np.errstate(over="ignore"):  # byte 254: |value| >= 2^128 overflows as in float32
            exp_lo = (np.array([E2M1_VALUES[b & 0xF] for b in bytes_]) * scale).astype(np.float32)
            exp_hi = (np.array([E2M1_VALUES[b >> 4] for b in bytes_]) * scale).astype(np.float32)
        if scale_byte == 255:
            assert np.all(np.isnan(got_lo)) and np.all(np.isnan(got_hi))
            continue
        np.testing.assert_array_equal(got_lo, exp_lo)
        np.testing.assert_array_equal(got_hi, exp_hi)
        np.testing.assert_array_equal(np.signbit(got_lo), np.signbit(exp_lo))
        np.testing.assert_array_equal(np.signbit(got_hi), np.signbit(exp_hi))


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 129, 200, 254, 255])
def test_pairs_asm_decode_every_byte_pattern(scale_byte):
    """The "pairs" PTX (Mosaic GPU kernel): byte k of the register -> output register $k holding
    E2M1(low nibble) x scale in its low bfloat16 lane and E2M1(high nibble) x scale in its high
    lane, bit for bit (signs included), every byte value in every position, each scale edge."""
    rng = np.random.default_rng(1000 + scale_byte)
    sbits = int(np.asarray(e8m0_to_bf16_bits(jnp.uint8(scale_byte))))
    words = [int(v) for v in rng.integers(0, 2**32, 64, dtype=np.uint64)]
    words += [b * 0x01010101 for b in range(256)] + [b << 24 for b in range(256)]
    scale = np.float64(2.0) ** (scale_byte - 127)
    for q in words:
        regs = run_ptx(e2m1_asm._DECODE_PAIRS_PTX, {4: q, 5: sbits | (sbits << 16)})
        for k in range(4):
            byte = (q >> (8 * k)) & 0xFF
            got = _bf16_pair_values(regs[f"${k}"])
            with np.errstate(over="ignore"):
                want = (np.array([E2M1_VALUES[byte & 0xF], E2M1_VALUES[byte >> 4]]) * scale).astype(np.float32)
            if scale_byte == 255:
                assert np.all(np.isnan(got))
                continue
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 129, 200, 254, 255])
def test_lanes_asm_decode_equals_pairs_on_regrouped_words(scale_byte, rng):
    """The "lanes" PTX on a word regrouped by lanes_order_bytes gives, output for output and bit
    for bit, what the "pairs" PTX gives on the original word (every byte value in every position,
    fresh random words, each scale edge); so the "lanes" kernel computes the same product."""
    from jax_mxfp4.decode_prepared import lanes_order_bytes

    sbits = int(np.asarray(e8m0_to_bf16_bits(jnp.uint8(scale_byte))))
    words = [int(v) for v in rng.integers(0, 2**32, 200, dtype=np.uint64)]
    words += [b * 0x01010101 for b in range(256)] + [b << (8 * (b % 4)) for b in range(256)]
    as_bytes = np.array(words, np.uint32).view(np.uint8).reshape(-1, 4)  # little-endian bytes per word
    regrouped = lanes_order_bytes(as_bytes).reshape(-1).view(np.uint32)
    for q, ql in zip(words, regrouped.tolist()):
        want = run_ptx(e2m1_asm._DECODE_PAIRS_PTX, {4: q, 5: sbits | (sbits << 16)})
        got = run_ptx(e2m1_asm._DECODE_LANES_PTX, {4: ql, 5: sbits | (sbits << 16)})
        for k in range(4):
            assert got[f"${k}"] == want[f"${k}"], (hex(q), hex(ql), k)


def test_fold_scale_bits_are_two_to_the_b_minus_one():
    """fold_scale_bits(b) (the kernel's b x FOLD_SCALE_MUL + FOLD_SCALE_ADD) is the bfloat16 of
    2^(b-1) in both lanes for every E8M0 byte b in 0..FOLD_MAX_BYTE (float64 reference through
    ml_dtypes); bytes above refused (2^(b-1) would overflow bfloat16)."""
    for b in range(e2m1_asm.FOLD_MAX_BYTE + 1):
        bits = e2m1_asm.fold_scale_bits(b)
        np.testing.assert_array_equal(_bf16_pair_values(bits), [2.0 ** (b - 1)] * 2)
    assert e2m1_asm.FOLD_MAX_BYTE == 128  # 2^127 is bfloat16's largest power of two
    for b in (129, 255, -1, np.uint8(200)):
        with pytest.raises(ValueError, match="E8M0 byte must be in 0..128"):
            e2m1_asm.fold_scale_bits(b)
    # a NumPy byte is taken (np.uint8 must not overflow in the multiply)
    assert e2m1_asm.fold_scale_bits(np.uint8(128)) == e2m1_asm.fold_scale_bits(128) == 0x7F007F00
    for bad in (True, np.bool_(False), 1.0, np.float32(3), "5", None):
        with pytest.raises(TypeError, match="E8M0 byte must be an int"):
            e2m1_asm.fold_scale_bits(bad)


@pytest.mark.parametrize("decode", ["LANES", "PAIRS"])
@pytest.mark.parametrize("scale_byte", [0, 1, 2, 64, 100, 126, 127, 128, "random"])
def test_fold_asm_equals_two_multiplies_bit_for_bit(scale_byte, decode, rng):
    """The folded "lanes" and "pairs" PTX (one multiply by 2^(b-1)) give the two-multiply form's
    outputs bit for bit (signs, the E2M1 0.5 at the smallest scales where the product is a
    bfloat16 subnormal) on every byte value in every position and fresh random words, for the
    E8M0 bytes it is used for (b <= 128)."""
    plain, folded = getattr(e2m1_asm, f"_DECODE_{decode}_PTX"), getattr(e2m1_asm, f"_DECODE_{decode}_FOLD_PTX")
    if scale_byte == "random":
        scale_byte = int(rng.integers(0, e2m1_asm.FOLD_MAX_BYTE + 1))
    sbits = int(np.asarray(e8m0_to_bf16_bits(jnp.uint8(scale_byte))))
    words = [int(v) for v in rng.integers(0, 2**32, 200, dtype=np.uint64)]
    words += [b * 0x01010101 for b in range(256)] + [b << (8 * (b % 4)) for b in range(256)]
    fold = e2m1_asm.fold_scale_bits(scale_byte)
    for q in words:
        want = run_ptx(plain, {4: q, 5: sbits | (sbits << 16)})
        got = run_ptx(folded, {4: q, 5: fold})
        for k in range(4):
            assert got[f"${k}"] == want[f"${k}"], (hex(q), scale_byte, k)


def test_quad_transpose_gives_the_pairs_order_in_every_quad(rng):
    """``QUAD_SELECTORS_PTX`` + ``QUAD_TRANSPOSE_PTX`` in a warp: lane 4r + l holds natural bytes
    4l..4l+3 of row r's 16-byte block and ends with what ``pair_order_bytes`` stores there (byte
    t = natural byte 4t + l), for random bytes; then the "pairs" decode of that word gives the
    natural elements 8t + 2l, 8t + 2l + 1 (the fragment columns of the WGMMA layout)."""
    from jax_mxfp4.decode_prepared import pair_order_bytes

    blocks = rng.integers(0, 256, size=(8, 16), dtype=np.uint8)  # 8 rows (quads) x one 16-byte block
    words = blocks.view("<u4")  # [8, 4]: lane 4r + l holds word l of row r
    sel = run_ptx_warp(e2m1_asm.QUAD_SELECTORS_PTX, [{} for _ in range(32)])
    out = run_ptx_warp(e2m1_asm.QUAD_TRANSPOSE_PTX,
                       [{1: int(words[lane // 4, lane % 4]), 2: sel[lane]["$0"], 3: sel[lane]["$1"]} for lane in range(32)])
    got = np.array([out[lane]["$0"] for lane in range(32)], "<u4").reshape(8, 4).view(np.uint8).reshape(8, 16)
    np.testing.assert_array_equal(got, np.asarray(pair_order_bytes(jnp.asarray(blocks))))
    # each output word through the "pairs" decode (scale 1.0): elements 8t + 2l, +1 of the row
    elems = E2M1_VALUES[np.stack([blocks & 15, blocks >> 4], -1).reshape(8, 32)]
    one = 0x3F803F80
    for lane in range(0, 32, 3):
        r, l = divmod(lane, 4)
        dec = run_ptx(e2m1_asm._DECODE_PAIRS_PTX, {4: out[lane]["$0"], 5: one})
        for t in range(4):
            np.testing.assert_array_equal(_bf16_pair_values(dec[f"${t}"]), elems[r, 8 * t + 2 * l: 8 * t + 2 * l + 2])


def test_warp_model_shuffles_between_the_right_lanes():
    """The model itself: bfly 1 and 2 exchange with lane ^ 1 and lane ^ 2 (a model that could fail)."""
    asm = "{\nshfl.sync.bfly.b32 a, $1, 1, 0x1f, 0xffffffff;\nshfl.sync.bfly.b32 b, $1, 2, 0x1f, 0xffffffff;\n}"
    out = run_ptx_warp(asm, [{1: 100 + lane} for lane in range(32)])
    assert [o["a"] for o in out] == [100 + (lane ^ 1) for lane in range(32)]
    assert [o["b"] for o in out] == [100 + (lane ^ 2) for lane in range(32)]


def test_even_odd_split_pairs_with_nibbles():
    """split_even_odd(x) meets the (lo, hi) nibble tiles: the split dot equals the natural one
    (exactly, on small integers)."""
    rng = np.random.default_rng(1)
    k = 64
    codes = rng.integers(0, 16, (3, k)).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    x = rng.integers(-4, 5, (2, k)).astype(np.float32)
    lo, hi = E2M1_VALUES[packed & 0xF], E2M1_VALUES[packed >> 4]
    x_lo, x_hi = (np.asarray(v) for v in e2m1_asm.split_even_odd(jnp.asarray(x)))
    np.testing.assert_array_equal(x_lo @ lo.T + x_hi @ hi.T, x @ E2M1_VALUES[codes].T)


def _reference(x, q):
    return np.einsum("bmk,bnk->bmn", np.asarray(x, np.float64), np.asarray(mx.dequantize(q), np.float64))


@pytest.mark.parametrize(
    "b,m,n,k,cfg",
    [
        (1, 5, 72, 256, WTileConfig(bn=64, bm=16, bk=64, split_k=2, decode="f16")),  # ragged M, N
        (2, 20, 40, 96, WTileConfig(bn=32, bm=16, bk=32, decode="f16")),  # batch, K = 3 blocks
        (1, 33, 64, 128, WTileConfig(bn=64, bm=32, bk=64, split_k=2, decode="f16")),
    ],
)
def test_weight_stationary_matches_float64(b, m, n, k, cfg):
    rng = np.random.default_rng(m * n + k)
    x = jnp.asarray(rng.standard_normal((b, m, k)), jnp.bfloat16)
    w = rng.standard_normal((b, n, k)) * np.exp2(rng.integers(-20, 20, (b, n, k // 32)).repeat(32, -1))
    q = mx.quantize(jnp.asarray(w, jnp.float32), axis=2)
    out = weight_stationary_gemm(x, q.data, as_scale_bytes(q.plain_scales()), out_dtype=jnp.float32,
                                 cfg=cfg, interpret=True)
    ref = _reference(x, q)
    mag = np.einsum("bmk,bnk->bmn", np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(mx.dequantize(q), np.float64)))
    assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= 2 * k * 2.0**-24 * mag)


def test_weight_stationary_rejects_bad_input():
    x = jnp.zeros((1, 4, 64), jnp.bfloat16)
    d = jnp.zeros((1, 8, 32), jnp.uint8)
    s = jnp.zeros((1, 8, 2), jnp.uint8)
    with pytest.raises(ValueError, match="interpreter"):
        weight_stationary_gemm(x, d, s, out_dtype=jnp.float32, cfg=WTileConfig(bk=64), interpret=True)
    with pytest.raises(ValueError, match="bfloat16"):
        weight_stationary_gemm(x.astype(jnp.float32), d, s, out_dtype=jnp.float32,
                               cfg=WTileConfig(bk=64, decode="f16"), interpret=True)
    with pytest.raises(ValueError, match="multiple of bk"):
        weight_stationary_gemm(x, d, s, out_dtype=jnp.float32, cfg=WTileConfig(bk=128, decode="f16"),
                               interpret=True)
    with pytest.raises(ValueError, match=r"\[B, N, K/2\]"):
        weight_stationary_gemm(x, d[:, :, :16], s, out_dtype=jnp.float32,
                               cfg=WTileConfig(bk=64, decode="f16"), interpret=True)
    with pytest.raises(ValueError, match="decode"):
        WTileConfig(decode="lut")


def test_default_config_covers_decode_and_odd_k():
    cfg = default_wconfig(16, 8192, 8192, num_sms=132)
    assert cfg.bm == 16 and 8192 % (cfg.bk * cfg.split_k) == 0 and cfg.split_k > 1
    for k in (32, 96, 160, 8192 + 32):
        c = default_wconfig(3, 100, k)
        assert k % (c.bk * c.split_k) == 0


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("side", ["w4a16 rhs", "w4a16 lhs", "a4w4 small lhs", "a4w4 small rhs"])
def test_pallas_backend_routes_through_weight_stationary(side):
    """dot_general with backend "pallas" (interpreter) equals backend "xla" within the float32
    reordering bound for every orientation the weight-stationary route takes."""
    rng = np.random.default_rng(len(side))
    k = 128
    small, big = 7, 48
    if side == "w4a16 rhs":
        lhs = jnp.asarray(rng.standard_normal((small, k)), jnp.bfloat16)
        rhs = mx.quantize(jnp.asarray(rng.standard_normal((big, k)), jnp.float32), axis=1)
    elif side == "w4a16 lhs":
        lhs = mx.quantize(jnp.asarray(rng.standard_normal((big, k)), jnp.float32), axis=1)
        rhs = jnp.asarray(rng.standard_normal((small, k)), jnp.bfloat16)
    elif side == "a4w4 small lhs":
        lhs = mx.quantize(jnp.asarray(rng.standard_normal((small, k)), jnp.float32), axis=1)
        rhs = mx.quantize(jnp.asarray(rng.standard_normal((big, k)), jnp.float32), axis=1)
    else:
        lhs = mx.quantize(jnp.asarray(rng.standard_normal((big, k)), jnp.float32), axis=1)
        rhs = mx.quantize(jnp.asarray(rng.standard_normal((small, k)), jnp.float32), axis=1)
    dims = (((1,), (1,)), ((), ()))
    kw = dict(preferred_element_type=jnp.float32)
    got = mx.dot_general(lhs, rhs, dims, recipe=mx.Recipe(backend="pallas", quantize_activations=False), **kw)
    ref = mx.dot_general(lhs, rhs, dims, recipe=mx.Recipe(backend="xla", quantize_activations=False), **kw)
    deq = [np.abs(np.asarray(mx.dequantize(v) if isinstance(v, mx.MXFP4Array) else v, np.float64)) for v in (lhs, rhs)]
    bound = 2 * k * 2.0**-24 * (deq[0] @ deq[1].T)
    assert got.shape == ref.shape
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) <= bound)


def test_decode_to_bf16_bit_exact():
    """The decode pass of the two-pass w4a16 route equals dequantize(q, bfloat16) bit for bit,
    over scales spanning 2^-60..2^60, signed zeros and a NaN block."""
    from jax_mxfp4.kernels.wgemm import decode_to_bf16

    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 1024)) * np.exp2(rng.integers(-60, 60, (128, 32)).repeat(32, -1))
    w[0, :32] = -0.0
    w[1, 64] = np.nan
    q = mx.quantize(jnp.asarray(w, jnp.float32), axis=1)
    got = decode_to_bf16(q.data, as_scale_bytes(q.plain_scales()), decode="f16", interpret=True)
    want = mx.dequantize(q, jnp.bfloat16)
    np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)), np.isnan(np.asarray(want, np.float32)))
    finite = ~np.isnan(np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16)[finite], np.asarray(want).view(np.uint16)[finite])
    with pytest.raises(ValueError, match="does not divide"):
        decode_to_bf16(q.data[:100], as_scale_bytes(q.plain_scales())[:100], decode="f16", interpret=True)


@pytest.mark.parametrize("out_dtype,gemm_out", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32),
                                                (jnp.float16, jnp.float32)])
def test_two_pass_route_gemm_writes_the_output_dtype(out_dtype, gemm_out, monkeypatch, rng):
    """The two-pass w4a16 route (large M on a GPU; here its decode kernel in the Pallas
    interpreter) asks XLA's GEMM for bfloat16 / float32 itself (no separate cast pass: 0.094 ms at
    8192^3 on the H200) and for float16 through float32; the product equals the
    float64 reference of x . dequantize(W)^T within float32 accumulation plus one rounding."""
    from jax_mxfp4.backends import pallas as pb
    from jax_mxfp4.backends.base import GemmProblem
    from jax_mxfp4.kernels import wgemm

    decode = wgemm.decode_to_bf16  # in the interpreter, whatever the route asks
    monkeypatch.setattr(wgemm, "decode_to_bf16", lambda *a, **kw: decode(*a, **{**kw, "interpret": True}))
    monkeypatch.setattr(pb, "decode_for", lambda platform: "f16")  # the portable decode (no PTX on a CPU)
    m, n, k = 256, 128, 512
    x = jnp.asarray(rng.standard_normal((1, m, k)), jnp.bfloat16)
    q = mx.quantize(jnp.asarray(rng.standard_normal((1, n, k)), jnp.float32), axis=2)
    problem = GemmProblem(batch=1, m=m, n=n, k=k, out_dtype=np.dtype(out_dtype), scale_layout="plain",
                          platform="cuda", lhs_kind="float", rhs_kind="mxfp4", lhs_dtype=np.dtype(jnp.bfloat16),
                          rhs_dtype=np.dtype(jnp.float32), precision="default")
    assert pb._plan(problem).kind == "two-pass"
    f = lambda a, b: pb.PallasBackend().gemm(a, b, problem)  # noqa: E731
    dots = [e for e in jax.make_jaxpr(f)(x, q).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [np.dtype(e.params["preferred_element_type"]) for e in dots] == [np.dtype(gemm_out)]
    got = np.asarray(jax.jit(f)(x, q), np.float64)
    assert got.dtype == np.float64 and jax.eval_shape(f, x, q).dtype == out_dtype
    xr, wr = np.asarray(x, np.float64)[0], np.asarray(mx.dequantize(q), np.float64)[0]
    ref, mag = xr @ wr.T, np.abs(xr) @ np.abs(wr).T
    ulp = {jnp.bfloat16: 2.0**-8, jnp.float32: 2.0**-24, jnp.float16: 2.0**-11}[out_dtype]
    assert np.all(np.abs(got[0] - ref) <= 2 * k * 2.0**-24 * mag + ulp * np.abs(ref) + 1e-30)


@pytest.mark.parametrize("capability, decode", [((9, 0), "asm"), ((10, 0), "asm"), ((8, 9), "f16"), ((8, 0), "f16"),
                                                (None, "f16")])
def test_inline_ptx_decode_only_where_ptxas_takes_it(monkeypatch, capability, decode):
    """The inline-PTX decode's ``mul.rn.bf16x2`` needs sm_90: Ampere and Ada GPUs, and a CUDA
    lowering where no GPU is visible (capability None), take the portable decode (the compiled
    check for each GPU generation: tests/test_cuda_compile.py)."""
    from jax_mxfp4.backends import fp8, pallas

    monkeypatch.setattr(fp8, "_compute_capability", lambda: capability)
    assert pallas.decode_for("cuda") == decode
    assert pallas.decode_for("rocm") == "f16" and pallas.decode_for("cpu") == "f16"
    assert "mul.rn.bf16x2" in e2m1_asm._scaled("$0", "$1")  # the instruction the rule is for


@pytest.mark.parametrize("capability, skipped", [((7, 5), True), ((8, 0), False), ((9, 0), False), (None, False)])
def test_pallas_kernels_skip_gpus_without_bfloat16_tensor_cores(monkeypatch, capability, skipped):
    """Turing (7.5) has no bfloat16 tensor cores: the Pallas backend and the MoE grouped kernel
    step aside there with a reason naming the rule, and "auto" takes another backend."""
    from jax_mxfp4.backends import fp8, grouped, pallas
    from jax_mxfp4.backends.base import GemmProblem

    monkeypatch.setattr(fp8, "_compute_capability", lambda: capability)
    problem = GemmProblem(batch=1, m=16, n=1024, k=2048, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain",
                          platform="cuda", lhs_kind="float", rhs_kind="mxfp4", lhs_dtype=np.dtype(jnp.bfloat16))
    reason = pallas.PallasBackend().rejects(problem)
    assert bool(reason) == skipped and bool(grouped.why_not("cuda")) == skipped
    if skipped:
        assert "compute capability >= 8.0" in reason and "7.5" in reason
        assert grouped.why_not("cuda") == reason
    assert pallas.cuda_capability_reason("rocm") is None
