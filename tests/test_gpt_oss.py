"""gpt-oss expert weights (``_blocks`` uint8 [E, N, K/32, 16], ``_scales`` uint8 [E, N, K/32]):
a file written here with NumPy from random E2M1 codes loads into MXFP4Array values equal, bit for
bit, to an independent float64 decode from the published table and nibble order; load -> save ->
load and to_gpt_oss(from_gpt_oss(b, s)) keep every byte; edge scale bytes and -0; every error."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402

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
    codes, _, _ = write_checkpoint(f, rng)
    weights = mx.load_gpt_oss(f)
    assert set(weights) == {GATE_UP, DOWN}
    for name, (c, s) in codes.items():
        w = weights[name]
        assert isinstance(w, mx.MXFP4Array)
        assert (w.shape, w.axis, w.dtype, w.scale_layout) == (c.shape, 2, jnp.bfloat16, "plain")
        assert_same_bits(mx.dequantize(w, jnp.float32), published_decode(c, s))


def test_reading_never_dequantizes(tmp_path, rng, monkeypatch):
    f = tmp_path / "model.safetensors"
    write_checkpoint(f, rng)

    def refuse(*args, **kwargs):
        raise AssertionError("load_gpt_oss decoded a weight")

    monkeypatch.setattr(mx.MXFP4Array, "dequantize", refuse)
    weights = mx.load_gpt_oss(f)
    raw = load_file(str(f))
    for name, w in weights.items():
        assert w.data.dtype == jnp.uint8 and w.scales.dtype == jnp.float8_e8m0fnu
        assert w.nbytes == raw[name + "_blocks"].nbytes + raw[name + "_scales"].nbytes


def test_load_save_load_keeps_every_byte_and_the_other_tensors(tmp_path, rng):
    src, out = tmp_path / "src.safetensors", tmp_path / "out.safetensors"
    _, tensors, others = write_checkpoint(src, rng)
    weights, extra = mx.load_gpt_oss(src, extra=True)
    assert set(extra) == set(others)
    mx.save_gpt_oss(out, weights, extra, metadata={"format": "pt"})
    again = load_file(str(out))
    assert set(again) == set(tensors)
    for k, v in tensors.items():
        assert again[k].dtype == v.dtype
        np.testing.assert_array_equal(again[k], v)
    reloaded = mx.load_gpt_oss(out)
    for name, w in weights.items():
        np.testing.assert_array_equal(np.asarray(reloaded[name].data), np.asarray(w.data))
        np.testing.assert_array_equal(np.asarray(reloaded[name].scales).view(np.uint8),
                                      np.asarray(w.scales).view(np.uint8))


def test_to_gpt_oss_inverts_from_gpt_oss_also_from_jax_arrays_and_swizzled_scales(rng):
    codes, scales = random_expert(rng, 3, 40, 96)
    blocks = pack(codes)
    for b, s in ((blocks, scales), (jnp.asarray(blocks), jnp.asarray(scales).view(jnp.float8_e8m0fnu))):
        w = mx.from_gpt_oss(b, s, jnp.float32)
        assert (w.shape, w.axis, w.dtype) == ((3, 40, 96), 2, jnp.float32)
        for v in (w, w.with_scale_layout("swizzled")):
            b2, s2 = mx.to_gpt_oss(v)
            assert b2.dtype == s2.dtype == np.uint8
            np.testing.assert_array_equal(b2, blocks)
            np.testing.assert_array_equal(s2, scales)


def test_quantized_expert_weight_exports_and_decodes_unchanged(rng):
    x = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
    q = mx.quantize(x, axis=2)
    back = mx.from_gpt_oss(*mx.to_gpt_oss(q), jnp.float32)
    assert_same_bits(mx.dequantize(back), mx.dequantize(q))


def test_edge_scale_bytes_0_254_255_negative_zero_e1_k32(tmp_path):
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)[None, None].repeat(4, axis=1)  # E=1, N=4, K=32
    scales = np.array([[[0], [254], [255], [127]]], np.uint8)
    f = tmp_path / "edge.safetensors"
    save_file({"e_blocks": pack(codes), "e_scales": scales}, str(f))
    w = mx.load_gpt_oss(f)["e"]
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
    b2, s2 = mx.to_gpt_oss(w)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(b2, pack(codes))


def test_names_select_pairs_sep_dot_and_pairs_split_over_shards(tmp_path, rng):
    codes, scales = random_expert(rng, 2, 4, 64)
    blocks = pack(codes)
    # the original OpenAI names: block.N.mlp.mlp1_weight.blocks / .scales
    f = tmp_path / "original.safetensors"
    save_file({"block.0.mlp.mlp1_weight.blocks": blocks, "block.0.mlp.mlp1_weight.scales": scales,
               "block.0.mlp.mlp2_weight.blocks": blocks[:1], "block.0.mlp.mlp2_weight.scales": scales[:1]}, str(f))
    w = mx.load_gpt_oss(f, ["block.0.mlp.mlp1_weight"], sep=".")
    assert list(w) == ["block.0.mlp.mlp1_weight"]
    assert list(mx.load_gpt_oss(f, "block.0.mlp.mlp2_weight", sep=".")) == ["block.0.mlp.mlp2_weight"]
    assert_same_bits(mx.dequantize(w["block.0.mlp.mlp1_weight"]), published_decode(codes, scales))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x_blocks": blocks, "n": np.ones(3, np.float32)}, str(a))
    save_file({"x_scales": scales}, str(b))
    weights, extra = mx.load_gpt_oss([a, b], extra=True)
    np.testing.assert_array_equal(mx.to_gpt_oss(weights["x"])[1], scales)
    assert list(extra) == ["n"]


def test_from_gpt_oss_errors_name_the_argument_and_rule(rng):
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (2, 3, 2), dtype=np.uint8)
    with pytest.raises(TypeError, match="w1_blocks: blocks must be uint8"):
        mx.from_gpt_oss(blocks.view(np.int8), scales, name="w1")
    with pytest.raises(TypeError, match="w1_scales: scales must be uint8"):
        mx.from_gpt_oss(blocks, scales.astype(np.float32), name="w1")
    with pytest.raises(ValueError, match=r"w1_blocks: blocks must have shape \[\.\.\., K/32, 16\]"):
        mx.from_gpt_oss(blocks.reshape(2, 3, 4, 8), scales, name="w1")
    with pytest.raises(ValueError, match=r"w1_blocks: blocks must have shape \[E, N, K/32, 16\].*rank 4"):
        mx.from_gpt_oss(blocks[0], scales[0], name="w1")
    with pytest.raises(ValueError, match=r"w1_scales: scales must have shape \(2, 3, 2\)"):
        mx.from_gpt_oss(blocks, scales[:, :2], name="w1")
    with pytest.raises(TypeError, match="dtype of w1"):
        mx.from_gpt_oss(blocks, scales, jnp.int8, name="w1")


def test_to_gpt_oss_errors_name_the_rule(rng):
    w = mx.from_gpt_oss(rng.integers(0, 256, (1, 2, 1, 16), dtype=np.uint8), np.full((1, 2, 1), 127, np.uint8))
    with pytest.raises(TypeError, match="w must be an MXFP4Array, got ndarray"):
        mx.to_gpt_oss(np.zeros((1, 2, 32), np.float32))
    with pytest.raises(ValueError, match=r"logical shape \[E, N, K\] \(3 dims\), got \(2, 32\)"):
        mx.to_gpt_oss(mx.quantize(jnp.ones((2, 32)), axis=1))
    with pytest.raises(ValueError, match="w is quantized along axis 1 .* along the last axis K"):
        mx.to_gpt_oss(mx.quantize(jnp.ones((1, 32, 2)), axis=1))
    with pytest.raises(ValueError, match="Hadamard rotation"):
        mx.to_gpt_oss(dataclasses.replace(w, hadamard=(32, 0)))


def test_save_errors_name_the_tensor(tmp_path, rng):
    w = mx.from_gpt_oss(rng.integers(0, 256, (1, 2, 1, 16), dtype=np.uint8), np.full((1, 2, 1), 127, np.uint8))
    f = str(tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"weights\['a'\] must be an MXFP4Array"):
        mx.save_gpt_oss(f, {"a": np.zeros((1, 2, 32), np.float32)})
    with pytest.raises(ValueError, match=r"weights\['a'\] is quantized along axis 0"):
        mx.save_gpt_oss(f, {"a": mx.quantize(jnp.ones((32, 1, 2)), axis=0)})
    with pytest.raises(TypeError, match="weights: tensor names must be str"):
        mx.save_gpt_oss(f, {0: w})
    with pytest.raises(TypeError, match=r"extra\['b'\] is an MXFP4Array"):
        mx.save_gpt_oss(f, {"a": w}, {"b": w})
    for bad in ("b_blocks", "b_scales"):
        with pytest.raises(ValueError, match=rf"extra\['{bad}'\]: .* half of an MXFP4 pair"):
            mx.save_gpt_oss(f, {"a": w}, {bad: np.zeros(2, np.uint8)})


def test_load_errors_name_the_tensor_or_path(tmp_path, rng):
    blocks = rng.integers(0, 256, (1, 2, 1, 16), dtype=np.uint8)
    scales = np.full((1, 2, 1), 127, np.uint8)
    cases = [
        ({"w_blocks": blocks}, ValueError, "w_blocks: found no matching w_scales tensor"),
        ({"w_scales": scales}, ValueError, "w_scales: found no matching w_blocks tensor"),
        ({"w_blocks": blocks.view(np.int8), "w_scales": scales}, TypeError, "w_blocks: blocks must be uint8"),
        ({"w_blocks": blocks, "w_scales": scales.astype(np.float32)}, TypeError, "w_scales: scales must be uint8"),
        ({"w_blocks": blocks, "w_scales": scales[:, :1]}, ValueError, r"w_scales: scales must have shape \(1, 2, 1\)"),
        ({"w_blocks": blocks.reshape(1, 2, 2, 8), "w_scales": scales}, ValueError, "w_blocks: blocks must have shape"),
        ({"w_blocks": blocks[0], "w_scales": scales[0]}, ValueError, "w_blocks: .*rank 4"),
    ]
    for i, (tensors, err, match) in enumerate(cases):
        f = tmp_path / f"case{i}.safetensors"
        save_file(tensors, str(f))
        with pytest.raises(err, match=match):
            mx.load_gpt_oss(f)
    ok = tmp_path / "ok.safetensors"
    save_file({"w_blocks": blocks, "w_scales": scales}, str(ok))
    with pytest.raises(ValueError, match=r"names: \['v'\] are not _blocks/_scales pairs .*\['w'\]"):
        mx.load_gpt_oss(ok, ["v"])
    with pytest.raises(ValueError, match="w_blocks: found in two files"):
        mx.load_gpt_oss([ok, ok])
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        mx.load_gpt_oss(tmp_path / "missing.safetensors")
    data = ok.read_bytes()
    for damage, content in (("random_bytes", rng.integers(0, 256, 300, dtype=np.uint8).tobytes()),
                            ("truncated", data[: len(data) // 2]), ("empty", b"")):
        bad = tmp_path / f"{damage}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=f"{bad}.* is not a readable safetensors file"):
            mx.load_gpt_oss(bad)
