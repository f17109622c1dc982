"""Runnable examples: ``python -m jax_mxfp4.examples.generate`` (serving: bf16 vs MXFP4 weights)."""
