"""Hugging Face weights in and out.

  llama.py          config.json <-> ModelConfig, parameter names, import and export
  safetensors.py    our own safetensors reader and writer
  export_folder.py  where an export may write; replacing a previous export whole
"""
