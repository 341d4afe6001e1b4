"""The bucket contract shared by the Macs and the trainer: store, layout, documents, records,
validation, HF folders and PULSE weights.

Imports numpy, zstandard, xxhash and msgspec only (aiobotocore in `store/s3.py`); never torch,
mlx, mlx_lm, transformers or slime (`tests/test_boundaries.py` holds it so).
"""
