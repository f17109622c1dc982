"""Cross-check against torchao's ``to_mx`` (skipped when torch/torchao are not installed; CI does
not install them, they are >1 GB). Issue contract: for finite normal float32 inputs each scale mode
is bit-for-bit what torchao gives. Run locally with ``pip install torch torchao``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
config = pytest.importorskip("torchao.prototype.mx_formats.config")

import jax.numpy as jnp  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402

MODES = {"floor": "FLOOR", "ceil": "CEIL", "even": "EVEN", "rceil": "RCEIL"}


def torchao_bytes(x: np.ndarray, mode: str):
    scale, data = mx_tensor.to_mx(
        torch.from_numpy(x), torch.float4_e2m1fn_x2, 32, getattr(config.ScaleCalculationMode, MODES[mode])
    )
    s = scale.view(torch.uint8).numpy().reshape(x.shape[0], -1)
    d = data.view(torch.uint8).numpy().reshape(x.shape[0], -1)
    return s, d


@pytest.mark.parametrize("mode", list(MODES))
def test_bit_for_bit_with_torchao_to_mx(mode, rng):
    rows = 512
    # normal float32 across the whole exponent range, plus exact ties and E2M1 grid points
    x = rng.standard_normal((rows, 64)) * np.exp2(rng.integers(-120, 120, (rows, 1)))
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.0, 7.5, 5.99, 6.01], np.float64)
    x[: rows // 4, : grid.size] = grid * np.exp2(rng.integers(-100, 100, (rows // 4, 1)))
    x = x.astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0
    ts, td = torchao_bytes(x, mode)
    q = mx.quantize(jnp.asarray(x), scale_mode=mode)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), ts)
    np.testing.assert_array_equal(np.asarray(q.data), td)
