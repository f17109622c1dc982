"""MXFP4 checkpoints (blocks/scales layout, safetensors): files written by the safetensors library
from NumPy arrays round-trip bit-exactly; decoded values equal an independent NumPy decode;
quantize() -> save -> load gives back the same bytes; bad tensors raise errors naming them."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from jax_mxfp4.checkpoint import from_blocks_scales, load_mxfp4, save_mxfp4, to_blocks_scales  # noqa: E402


def numpy_decode(blocks, scales):
    """Independent decode: low nibble = element 2i; E2M1 via ml_dtypes; x 2^(s-127); 0xFF -> NaN;
    values below 2^-126 become signed zeros (jax_mxfp4's documented dequantize rule)."""
    lo, hi = blocks & 0xF, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (32,))
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scales.astype(np.float64)
    out = vals * np.ldexp(1.0, (s - 127).astype(int))[..., None]
    out = np.where(np.abs(out) < 2.0 ** -126, np.copysign(0.0, out), out)
    out = np.where((scales == 255)[..., None], np.nan, out)
    return out.reshape(blocks.shape[:-2] + (-1,))


def random_pair(rng, lead, nblk):
    blocks = rng.integers(0, 256, size=lead + (nblk, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=lead + (nblk,), dtype=np.uint8)
    scales.flat[0] = 255  # a NaN block
    scales.flat[-1] = 0   # the smallest scale 2^-127
    return blocks, scales


def test_file_from_safetensors_round_trips_bit_exactly(tmp_path, rng):
    blocks, scales = random_pair(rng, (3, 5), 4)          # e.g. experts x rows x K/32
    norm = rng.standard_normal(7).astype(np.float32)
    src = tmp_path / "src.safetensors"
    save_file({"mlp.w1_blocks": blocks, "mlp.w1_scales": scales, "norm.weight": norm}, str(src))
    loaded = load_mxfp4(src)
    q = loaded["mlp.w1"]
    assert isinstance(q, mx.MXFP4Array) and q.shape == (3, 5, 128) and q.axis == 2 and q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(loaded["norm.weight"], norm)
    out = tmp_path / "out.safetensors"
    save_mxfp4(out, loaded)
    again = load_file(str(out))
    assert set(again) == {"mlp.w1_blocks", "mlp.w1_scales", "norm.weight"}
    np.testing.assert_array_equal(again["mlp.w1_blocks"], blocks)
    np.testing.assert_array_equal(again["mlp.w1_scales"], scales)
    assert again["mlp.w1_blocks"].dtype == again["mlp.w1_scales"].dtype == np.uint8


def test_decoded_values_equal_independent_numpy_decode(tmp_path, rng):
    blocks, scales = random_pair(rng, (6,), 3)
    q = from_blocks_scales(blocks, scales, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(mx.dequantize(q), np.float64), numpy_decode(blocks, scales))
    # moved to axis 0 (a Flax [K, N] kernel): the same values, transposed
    q0 = from_blocks_scales(blocks, scales, dtype=jnp.float32, axis=0)
    assert q0.shape == (96, 6) and q0.axis == 0
    np.testing.assert_array_equal(np.asarray(mx.dequantize(q0), np.float64), numpy_decode(blocks, scales).T)


@pytest.mark.parametrize("shape,axis", [((64, 24), 0), ((5, 96), 1), ((2, 64, 3), 1)])
def test_quantized_arrays_survive_save_and_load(tmp_path, shape, axis, rng):
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = mx.quantize(x, axis=axis)
    save_mxfp4(tmp_path / "q.safetensors", {"w": q, "swz": q.with_scale_layout("swizzled")})
    back = load_mxfp4(tmp_path / "q.safetensors", dtype=jnp.float32, axes={"w": axis, "swz": axis})
    for name, layout in (("w", "plain"), ("swz", "swizzled")):
        r = back[name]
        assert (r.shape, r.axis, r.scale_layout) == (q.shape, q.axis, layout)  # the layout is recorded
        np.testing.assert_array_equal(r.data, q.data)
        np.testing.assert_array_equal(np.asarray(r.plain_scales()).view(np.uint8), np.asarray(q.scales).view(np.uint8))
    b, s = to_blocks_scales(q)
    np.testing.assert_array_equal(numpy_decode(b, s), np.moveaxis(np.asarray(mx.dequantize(q), np.float64), axis, -1))


def test_wrong_tensors_name_themselves(tmp_path, rng):
    blocks, scales = random_pair(rng, (2,), 2)
    cases = [
        ({"a_blocks": blocks.astype(np.int8), "a_scales": scales}, TypeError, "a_blocks.*uint8"),
        ({"a_blocks": blocks, "a_scales": scales.astype(np.float32)}, TypeError, "a_scales.*uint8"),
        ({"a_blocks": blocks[..., :8], "a_scales": scales}, ValueError, "a_blocks.*16"),
        ({"a_blocks": blocks, "a_scales": scales[:, :1]}, ValueError, "a_scales.*shape"),
        ({"a_blocks": blocks}, ValueError, "a_blocks.*a_scales"),
        ({"a_scales": scales}, ValueError, "a_scales.*a_blocks"),
    ]
    for i, (tensors, err, match) in enumerate(cases):
        f = tmp_path / f"bad{i}.safetensors"
        save_file(tensors, str(f))
        with pytest.raises(err, match=match):
            load_mxfp4(f)
    with pytest.raises(TypeError, match="dtype of a"):
        from_blocks_scales(blocks, scales, dtype=jnp.int8, name="a")


@pytest.mark.parametrize("damage", ["random_bytes", "truncated", "empty"])
def test_a_file_that_is_not_safetensors_is_refused_naming_the_path(tmp_path, rng, damage):
    good = tmp_path / "good.safetensors"
    save_mxfp4(str(good), {"w": mx.quantize(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32), axis=-1)})
    bad = tmp_path / f"{damage}.safetensors"
    data = good.read_bytes()
    bad.write_bytes({"random_bytes": rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),
                     "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(ValueError, match=f"{bad}.* is not a readable safetensors file"):
        load_mxfp4(str(bad))
    with pytest.raises(FileNotFoundError):
        load_mxfp4(str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=f"{tmp_path} is a directory"):
        load_mxfp4(str(tmp_path))
