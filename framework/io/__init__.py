"""What a run reads and writes besides its metrics.

  data.py          token sources: synthetic, Markov, text, token files
  dataset.py       what every token source is (`Dataset`, its seed streams)
  tokenizer.py     byte-level and Hugging Face tokenizers
  checkpoint/      mesh-independent Orbax checkpoints, fingerprints, paths
  hf/              Hugging Face Llama folders in and out, safetensors
  weights.py       weights to generate from or export: a checkpoint or a HF folder
"""
