"""Hugging Face weights in and out.

  llama.py        config.json <-> ModelConfig, parameter names, import and export
  safetensors.py  our own safetensors reader and writer
"""
