"""Writes the Hugging Face test fixtures under tests/fixtures/hf/ (committed; run once).

NEEDS `torch` and `transformers`, which are NOT dependencies of this project and never
run in CI. Run it in a separate virtual environment, e.g.

    python3.11 -m venv /tmp/venv_hf
    /tmp/venv_hf/bin/pip install torch==2.13.0   # the CPU build; then:
    /tmp/venv_hf/bin/pip install transformers numpy
    /tmp/venv_hf/bin/python tools/make_hf_fixtures.py tests/fixtures/hf [NAME ...]
    /tmp/venv_hf/bin/python tools/make_hf_fixtures.py --check EXPORTED [FIXTURE]

With NAMEs, only those fixtures are (re)written.

`--check` loads a folder written by tools/export_hf.py with transformers
(AutoModelForCausalLM.from_pretrained), prints what it loaded and, given a fixture
whose weights it should hold, compares its logits with the fixture's.

Each fixture is a tiny model of one family written by `save_pretrained` (config.json,
generation_config.json + safetensors) plus what transformers computes from that
folder, reloaded in float32:
`logits.npy` for the token ids in `ids.npy` and `greedy.npy`, its greedy continuation
(`generate(do_sample=False)`) of the first row's first PROMPT tokens.

    tied_gqa            4 query / 2 kv heads, tied embeddings, plain RoPE, float32
    untied_gqa          untied LM head, plain RoPE, float32, written with the legacy
                        `rope_theta` key that published Llama folders use
    llama3_bf16_sharded untied, Llama 3 RoPE scaling (every branch: high, medium and
                        low frequencies), bfloat16, in 3 safetensors files + index
    qwen2_tied          Qwen2: q/k/v biases, tied embeddings, rope_theta 1e6, float32
    qwen3_head_dim      Qwen3: q/k norm, head_dim 16 where hidden/heads is 8, untied,
                        rope_theta 1e6, float32
    mistral_untied      Mistral: untied, sliding_window null (v0.2 on), rope_theta 1e6,
                        float32
    mistral_window      Mistral v0.1's form: a sliding window (5) on every layer, tied,
                        float32
    gemma2_window_softcap  Gemma 2: 4 layers (local, global, local, global), window 5,
                        attention and final soft-caps that bend the scores and logits,
                        query_pre_attn_scalar 12 (not head_dim 16), head_dim 16 where
                        hidden/heads is 8, tied (as Gemma 2), float32
    qwen3_moe           Qwen3-MoE: q/k norm, head_dim 16, 4 experts of 24, top 2 not
                        renormalised (norm_topk_prob false), every layer sparse, float32
    mixtral             Mixtral: 4 experts of 48 (intermediate_size), top 2, untied,
                        no window, float32
    qwen2_moe           Qwen2-MoE: q/k/v biases, 4 experts of 24, top 2 not
                        renormalised, a sigmoid-gated shared expert of 40
                        (shared_expert_intermediate_size), every layer sparse, untied,
                        float32
    qwen3_moe_dense_first  Qwen3-MoE with a dense layer first (mlp_only_layers [0], its
                        MLP intermediate_size 48 wide) and two MoE layers, top 2
                        renormalised, tied, float32
    qwen3_moe_sparse_step  Qwen3-MoE with MoE every 2nd layer (decoder_sparse_step 2)
                        after two dense ones (mlp_only_layers [0, 1]): 6 layers, MoE
                        at 3 and 5, untied, float32

The windows (5) are shorter than the ids (12 tokens) and than prompt + continuation
(4 + 16), so that they cut attention in both the logits and the greedy tokens.

Weights and biases are drawn with a larger spread than transformers' default and the
norm scales (q/k norm's too) are random, so that a mix-up of any two tensors changes the
logits visibly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
IDS_SHAPE, PROMPT, GREEDY_TOKENS = (2, 12), 4, 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


ROPE_1E6 = {"rope_theta": 1e6, "rope_type": "default"}  # Qwen2.5's, Qwen3's, Mistral v0.3's


def build(seed: int, config_class=LlamaConfig, **overrides):
    torch.manual_seed(seed)
    config = config_class(**{**SHAPE, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def record(folder: Path, ids: np.ndarray) -> None:
    """Reloads the folder as transformers would and stores its float32 outputs."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.float().numpy()
        model.generation_config.eos_token_id = None  # plain greedy, never stopping early
        out = model.generate(torch.tensor(ids[:1, :PROMPT]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False)
    np.save(folder / "ids.npy", ids.astype(np.int32))
    np.save(folder / "logits.npy", logits.astype(np.float32))
    np.save(folder / "greedy.npy", out[0, PROMPT:].numpy().astype(np.int32))


def to_legacy_rope_keys(folder: Path) -> None:
    """Rewrites config.json with `rope_theta` (+ `rope_scaling`) instead of newer
    transformers' `rope_parameters`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters", {}) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def saved(model, shard: str | None = None, then=None):
    """(folder -> None): writes the model there with save_pretrained, then `then`."""
    def write(folder: Path) -> None:
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        if then:
            then(folder)
    return write


FIXTURES = {  # name -> writer of the folder (models built when chosen)
    "tied_gqa": lambda: saved(build(1, tie_word_embeddings=True, rope_theta=10000.0)),
    "untied_gqa": lambda: saved(build(2, tie_word_embeddings=False, rope_theta=500.0),
                                then=to_legacy_rope_keys),
    "llama3_bf16_sharded": lambda: saved(build(
        3, tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0, **LLAMA3})
        .to(torch.bfloat16), shard="14KB"),
    "qwen2_tied": lambda: saved(build(4, Qwen2Config, tie_word_embeddings=True,
                                      rope_parameters=ROPE_1E6)),
    "qwen3_head_dim": lambda: saved(build(5, Qwen3Config, tie_word_embeddings=False,
                                          head_dim=16, rope_parameters=ROPE_1E6)),
    "mistral_untied": lambda: saved(build(6, MistralConfig, tie_word_embeddings=False,
                                          sliding_window=None, rope_parameters=ROPE_1E6)),
    "mistral_window": lambda: saved(build(7, MistralConfig, tie_word_embeddings=True,
                                          sliding_window=5)),
    "gemma2_window_softcap": lambda: saved(build(
        8, Gemma2Config, num_hidden_layers=4, head_dim=16, tie_word_embeddings=True,
        sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0)),
    "qwen3_moe": lambda: saved(build(
        9, Qwen3MoeConfig, head_dim=16, tie_word_embeddings=False, rope_parameters=ROPE_1E6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)),
    "mixtral": lambda: saved(build(
        10, MixtralConfig, tie_word_embeddings=False, sliding_window=None,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        router_jitter_noise=0.0)),
    "qwen2_moe": lambda: saved(build(
        11, Qwen2MoeConfig, tie_word_embeddings=False, rope_parameters=ROPE_1E6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, use_sliding_window=False)),
    "qwen3_moe_dense_first": lambda: saved(build(
        12, Qwen3MoeConfig, num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
        rope_parameters=ROPE_1E6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0], router_aux_loss_coef=0.001)),
    "qwen3_moe_sparse_step": lambda: saved(build(
        13, Qwen3MoeConfig, num_hidden_layers=6, head_dim=16, tie_word_embeddings=False,
        rope_parameters=ROPE_1E6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[0, 1], router_aux_loss_coef=0.001)),
}


def main(out: str, names: list[str]) -> None:
    root = Path(out)
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], IDS_SHAPE)
    for name in names or FIXTURES:
        FIXTURES[name]()(root / name)
        record(root / name, ids)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: wrote "
          f"{', '.join(names or FIXTURES)} in {root}")


def check(exported: str, fixture: str | None = None) -> None:
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__} loaded {exported}: "
          f"{type(model).__name__}, {n} parameters, config {model.config.to_diff_dict()}")
    if fixture:
        ids = np.load(Path(fixture) / "ids.npy")
        want = np.load(Path(fixture) / "logits.npy")
        with torch.no_grad():
            got = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
        print(f"logits vs {fixture}: max relative difference "
              f"{np.abs(got - want).max() / np.abs(want).max():.3g}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(*sys.argv[2:4])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf", sys.argv[2:])
