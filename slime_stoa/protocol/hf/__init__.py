"""Hugging Face model folders: safetensors reading and writing, shards, config files."""
