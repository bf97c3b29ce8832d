"""Hugging Face weights in and out (Llama, Qwen2, Qwen3, Mistral, Gemma 2).

  family.py         config.json <-> ModelConfig for each model family; what is refused
  llama.py          the Llama layout's tensor names (all four families), import and export
  safetensors.py    our own safetensors reader and writer
  export_folder.py  where an export may write; replacing a previous export whole
"""
