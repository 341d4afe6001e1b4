"""LFM2 and LFM2-MoE (model types `lfm2`, `lfm2_moe`: LFM2.5-8B-A1B) on slime's Megatron backend.

- `convert`: the HF <-> Megatron name and tensor mapping, both ways (pure; numpy or torch), and
  the conversion command `python -m slime_stoa.trainer.slime.lfm2.convert`.
- `flags`: slime's model flags for an LFM2 config (`python -m ...lfm2.flags HF_DIR`). Torch-free.
- `conv`: the gated short convolution as the mixer of a Megatron layer.
- `moe`: LFM2-MoE's routing, exactly transformers' `Lfm2MoeTopKRouter`.
- `spec`: the Megatron model (`provider` for slime's `--custom-model-provider-path`), which also
  registers the HF loader with slime (needs megatron-core).
- `cpu`: megatron-core on the CPU for checks and tests; `gpucheck`: the provider on one GPU.
"""
