"""gpt-oss expert weights through the checkpoint functions (``_blocks`` uint8 [E, N, K/32, 16],
``_scales`` uint8 [E, N, K/32]: the layout of :mod:`jax_mxfp4.checkpoint`): a file written here
with NumPy from random E2M1 codes loads into MXFP4Arrays [E, N, K] quantized along K whose values
equal, bit for bit, an independent float64 decode from the published table and nibble order
(OpenAI gpt-oss ``gpt_oss/torch/weights.py``: ``FP4_VALUES``, ``idx_lo = blk & 0x0F`` fills the
even elements, ``ldexp(out, scales - 127)``; the same in Hugging Face transformers
``integrations/mxfp4.py``); nothing is dequantized on the way; load -> save -> load keeps every
byte; edge scale bytes and -0."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from jax_mxfp4.checkpoint import load_mxfp4, save_mxfp4, to_blocks_scales  # noqa: E402

# gpt-oss gpt_oss/torch/weights.py FP4_VALUES (the same list in transformers integrations/mxfp4.py).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float64)
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def pack(codes):
    """4-bit codes [E, N, K] -> blocks [E, N, K/32, 16]: the published rule, element 2j in the
    low nibble of byte j (gpt-oss ``idx_lo = blk & 0x0F`` -> ``out[:, 0::2]``)."""
    byte = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return byte.reshape(codes.shape[:-1] + (codes.shape[-1] // 32, 16)).astype(np.uint8)


def published_decode(codes, scales):
    """float32 values of codes [E, N, K] with E8M0 scales [E, N, K/32], computed in float64:
    FP4_VALUES[code] * 2^(b - 127); b = 255 is NaN (OCP MX v1.0 §5.4.1); then jax_mxfp4's float32
    contract: |v| < 2^-126 -> a zero of v's sign, overflow -> ±inf."""
    b = np.repeat(scales.astype(np.float64), 32, axis=-1)
    v = FP4_VALUES[codes] * np.exp2(b - 127)
    v = np.where(np.abs(v) < 2.0 ** -126, np.copysign(0.0, v), v)
    v = np.where(np.repeat(scales, 32, axis=-1) == 255, np.nan, v)
    with np.errstate(over="ignore"):
        return v.astype(np.float32)


def assert_same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[ok], want.view(np.uint32)[ok])


def random_expert(rng, e, n, k):
    codes = rng.integers(0, 16, size=(e, n, k), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(e, n, k // 32), dtype=np.uint8)
    return codes, scales


def write_checkpoint(path, rng):
    """A small gpt-oss-shaped file: 4 experts, hidden 64, intermediate 32 (gate_up [E, 2*I, H],
    down [E, H, I]), their biases and a norm."""
    gu_codes, gu_scales = random_expert(rng, 4, 64, 64)
    dn_codes, dn_scales = random_expert(rng, 4, 64, 32)
    others = {GATE_UP + "_bias": rng.standard_normal((4, 64)).astype(np.float32),
              DOWN + "_bias": rng.standard_normal((4, 64)).astype(np.float32),
              "model.norm.weight": rng.standard_normal(64).astype(np.float32)}
    tensors = {GATE_UP + "_blocks": pack(gu_codes), GATE_UP + "_scales": gu_scales,
               DOWN + "_blocks": pack(dn_codes), DOWN + "_scales": dn_scales, **others}
    save_file(tensors, str(path))
    return {GATE_UP: (gu_codes, gu_scales), DOWN: (dn_codes, dn_scales)}, tensors, others


def test_hand_made_file_decodes_as_published_table_and_nibble_order(tmp_path, rng):
    f = tmp_path / "model.safetensors"
    codes, _, others = write_checkpoint(f, rng)
    loaded = load_mxfp4(f)
    assert set(loaded) == {GATE_UP, DOWN, *others}
    for name, (c, s) in codes.items():
        w = loaded[name]
        assert isinstance(w, mx.MXFP4Array)
        assert (w.shape, w.axis, w.dtype, w.scale_layout) == (c.shape, 2, jnp.bfloat16, "plain")
        assert_same_bits(mx.dequantize(w, jnp.float32), published_decode(c, s))
    for name, v in others.items():
        np.testing.assert_array_equal(loaded[name], v)


def test_reading_never_dequantizes(tmp_path, rng, monkeypatch):
    f = tmp_path / "model.safetensors"
    write_checkpoint(f, rng)

    def refuse(*args, **kwargs):
        raise AssertionError("load_mxfp4 decoded a weight")

    monkeypatch.setattr(mx.MXFP4Array, "dequantize", refuse)
    monkeypatch.setattr(mx, "dequantize", refuse)
    loaded = load_mxfp4(f)
    raw = load_file(str(f))
    for name in (GATE_UP, DOWN):
        w = loaded[name]
        assert w.data.dtype == jnp.uint8 and w.scales.dtype == jnp.float8_e8m0fnu
        assert w.data.nbytes + w.scales.nbytes == raw[name + "_blocks"].nbytes + raw[name + "_scales"].nbytes


def test_load_save_load_keeps_every_byte_and_the_other_tensors(tmp_path, rng):
    src, out = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _, tensors, _ = write_checkpoint(src, rng)
    save_mxfp4(out, load_mxfp4(src), metadata={"format": "pt"})
    raw = load_file(str(out))
    assert set(raw) == set(tensors)
    for name, v in tensors.items():
        np.testing.assert_array_equal(raw[name], v)
        assert raw[name].dtype == v.dtype


def test_edge_scale_bytes_0_254_255_negative_zero_e1_k32(tmp_path):
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)[None, None].repeat(4, axis=1)  # E=1, N=4, K=32
    scales = np.array([[[0], [254], [255], [127]]], np.uint8)
    f = tmp_path / "edge.safetensors"
    save_file({"e_blocks": pack(codes), "e_scales": scales}, str(f))
    w = load_mxfp4(f)["e"]
    got = np.asarray(mx.dequantize(w, jnp.float32))[0]
    assert_same_bits(got[None], published_decode(codes, scales))
    row0, row254, row255, row127 = got
    # byte 127: the table itself, -0 (code 0x8) keeps its sign
    assert_same_bits(row127, FP4_VALUES[codes[0, 0]])
    assert np.signbit(row127[8]) and row127[8] == 0 and not np.signbit(row127[0])
    # byte 0 (2^-127): only magnitudes >= 2 stay above 2^-126; the rest are signed zeros
    assert row0[4] == 2.0 ** -126 and row0[15] == -6 * 2.0 ** -127
    assert (row0[[1, 2, 3]] == 0).all() and np.signbit(row0[[9, 10, 11]]).all() and (row0[[9, 10, 11]] == 0).all()
    # byte 254 (2^127): 1.5 x 2^127 is finite, 2 x 2^127 overflows float32
    assert row254[3] == 1.5 * 2.0 ** 127 and row254[4] == np.inf and row254[12] == -np.inf
    # byte 255: NaN in E8M0 (OCP MX v1.0 §5.4.1), the whole block, zeros included
    assert np.isnan(row255).all()
    b2, s2 = to_blocks_scales(w)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(b2, pack(codes))
