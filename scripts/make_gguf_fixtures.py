#!/usr/bin/env python3
"""Write the GGUF fixtures: tiny HF models converted by llama.cpp's own converter.

Everything lands in tests/fixtures/gguf/:

* `{name}-{type}.gguf`: a tiny random-init HF model (`LlamaForCausalLM`,
  `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, float32, with a byte-level BPE
  tokenizer), saved with `save_pretrained` into a throwaway folder and
  converted by llama.cpp's `convert_hf_to_gguf.py --outtype {type}`
  (f32, f16, bf16, q8_0), unchanged.
* `expected.safetensors`: for each model, a prompt's ids
  (`{name}.input_ids`) and HF's logits for every file
  (`{name}.{type}.logits`): HF's model with each weight rounded to the type
  its GGUF tensor is stored in (gguf-py's own `quantize` then `dequantize`,
  what the converter wrote) and computed in float32, so the oracle is exact
  for every type (f32: the float32 model's own logits). The description is
  a JSON string in the metadata under "case": the prompts with HF's ids,
  decoded text and greedy continuation (ending at the file's end tokens),
  the end tokens, each file's tensor types, and the versions.
* `llama256-{type}.gguf`: a Llama wide enough for the k-quants (rows of
  256), converted to f32 by the converter (not kept) and quantized by
  llama.cpp's own `llama-quantize` (q4_0, q4_k_m, q5_k_m, q6_k, q3_k_m,
  q2_k: llama.cpp's mixes, each picking its types per tensor).
* `{smollm3,olmo2,gemma3}-f32.gguf`, `gemma2-{f32,q8_0}.gguf` and
  `expected-archs.safetensors`: as the first files and
  `expected.safetensors` (`{name}.input_ids`, `{name}.{type}.logits`, the
  same "case"), for the architectures llama.cpp names `smollm3`, `olmo2`,
  `gemma2` and `gemma3`, kept apart so that the other files stay as they
  were.
* `expected-quantized.safetensors`: as `expected.safetensors` for those
  files (`llama256.input_ids`, `llama256.{type}.logits`), kept apart so that
  the first file stays as it was. gguf-py cannot make a k-quant, so the
  oracle reads the weights back instead: HF's model with every weight
  replaced by gguf-py's `dequantize` of the tensor the file stores (q and k
  un-permuted), computed in float32. Each prompt's greedy continuation is
  given for the float32 model (`greedy`) and for each file's weights
  (`greedy_by_type`), with each step's top-2 margin: a small one is a step
  that quantized activations may flip.

The models:

* `llama`: arch `llama`, 4 query heads sharing 2 kv heads, q/k/v/o biases:
  the converter permutes q and k (weights and biases) for llama.cpp's
  interleaved rotary; the tokenizer's pre-tokenizer is GPT-2's (`gpt-2`).
* `qwen2`: arch `qwen2`, one kv head, q/k/v biases, tied embeddings (no
  `output.weight`), not permuted; Qwen2's pre-tokenizer and NFC (`qwen2`).
* `qwen3`: arch `qwen3`, q/k RMSNorms, head_dim 16 with hidden 32 and 4
  heads (`attention.key_length`); Llama 3's pre-tokenizer (`llama-bpe`).
* `smollm3`: arch `smollm3` (`SmolLM3ForCausalLM`), 4 layers, the last
  without rotary: llama.cpp writes no key for SmolLM3's layers without
  rotary and takes every fourth (`n_no_rope_layer_step`, its
  `src/models/smollm3.cpp`), which is HF's default `no_rope_layer_interval`
  4, so the HF model has that pattern (a GGUF file cannot carry another).
  The converter permutes q and k as for `llama`; tied embeddings, 2 kv
  heads, rope_theta 2e6; Llama 3's pre-tokenizer (`llama-bpe`).
* `olmo2`: arch `olmo2` (`Olmo2ForCausalLM`): RMSNorms after attention and
  MLP (`post_attention_norm`, `post_ffw_norm`; gguf-py maps OLMo 2's
  `post_attention_layernorm` there, not to `ffn_norm`), q/k RMSNorms over
  all heads at once, not permuted; untied, 2 kv heads, rope_theta 5e5;
  GPT-2's pre-tokenizer.
* `gemma2`: arch `gemma2` (`Gemma2ForCausalLM`): four norms a block, which
  the converter stores as `1 + w` (`attn_norm`, `post_attention_norm`,
  `ffn_norm` for `pre_feedforward_layernorm`, `post_ffw_norm`), 4 layers
  alternating sliding (window 4, shorter than the prompt) and full as
  llama.cpp's default pattern has them, soft-caps 4 (scores) and 6
  (logits), small enough to bend them, query_pre_attn_scalar = head_dim =
  16 (llama.cpp scales by head_dim^-1/2 but for the 27B), rope_theta 10000
  (the converter writes no rope base for Gemma 2), tied, 2 kv heads. Its
  norm weights are drawn around 0, as Gemma's scale by `1 + w`. The
  converter reads Gemma 2's tokenizer only from a SentencePiece
  tokenizer.model; it is given Gemma 3's reading of a tokenizer.json
  (`_set_vocab_gpt2`), so both Gemmas have the others' BPE tokenizer.
* `gemma3`: arch `gemma3` (`Gemma3ForCausalLM`): Gemma 2's block with
  q/k RMSNorms per head and no soft-caps, 6 layers, the last full
  (llama.cpp's default pattern, 6), window 4, rope bases 1e6 (full layers,
  `rope.freq_base`) and 5e4 (sliding, `rope.freq_base_swa`), untied.
* `llama256`: arch `llama`, hidden and intermediate 256 (every matrix's
  rows a whole number of 256-element super-blocks), one layer (six files
  of two layers would be 3.6 MB), 4 query heads sharing 2 kv heads, no
  biases, rope_theta 10000, untied, GPT-2's pre-tokenizer. Weights at
  initializer_range 0.05: a random net this wide moves its logits by a
  share of their size that grows with the init under 4-bit weights (q4_k_m:
  0.2 at 0.05, 0.4 at 0.1, 0.7 at 0.2, max |diff| / max |logit|).

* `phi3-f32.gguf`: tests/fixtures/decoders/phi3 (`Phi3ForCausalLM`,
  written by make_decoder_fixtures.py) converted as it is, arch `phi3`:
  fused `attn_qkv` and `ffn_up` (gate rows, then up), LongRoPE's factors
  as the tensors `rope_factors_long` / `rope_factors_short`, partial
  rotary as `rope.dimension_count`. Its oracle is that folder's
  `phi3_expected.safetensors`, so nothing here is computed for it; the
  folder has no tokenizer, so a byte-level one of its 128 tokens (no
  merges) is put beside a copy for the converter. `--only phi3` remakes
  this file alone (no llama-quantize needed).

The tokenizer is tests/fixtures/text/llama3's (384 tokens, 5 special ones)
with the pre-tokenizer each model's tokenizer has. The converter recognises
a pre-tokenizer by hashing a real tokenizer's output, which these tiny ones
cannot match: `get_vocab_base_pre` is replaced by the name the pre-tokenizer
has in llama.cpp (`src/llama-vocab.cpp`), nothing else.

Each model's seed is the first whose greedy steps all beat the runner-up by
MIN_MARGIN, so that 1e-5 differences cannot flip a token (llama256: its
float32 model's steps; its quantized files' margins are only recorded).

Needs the venv of scripts/requirements.txt and llama.cpp's source (its
`convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`; e.g. the
llama-cpp-python sdist's vendor/llama.cpp) with `llama-quantize` built
(`cmake --build build --target llama-quantize`); offline, under a minute:

    .venv-ref/bin/python scripts/make_gguf_fixtures.py --llama-cpp PATH/TO/llama.cpp \
        [--llama-quantize PATH/TO/llama-quantize] [--only expected-archs.safetensors ...]

`--only` remakes the files of the groups named by their expected file (the
others stay; llama-quantize is needed only for `expected-quantized`).
"""

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "text", "llama3")

VOCAB = 384
MAX_NEW = 8
MIN_MARGIN = 1e-2
SEEDS = range(100)
PROMPTS = [
    "Hello world, the attention is all you need.",
    "日本語 12345 I'VE\n\n  ok 🦙!",
    "naïve café: don't panic",
]

# llama.cpp's pre-tokenizer regexes as HF's tokenizer.json files write them.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama_config():
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=50000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
        mlp_bias=False, initializer_range=0.2, bos_token_id=0, eos_token_id=[1, 4],
        pad_token_id=None, attn_implementation="eager",
    )


def qwen2_config():
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        initializer_range=0.2, bos_token_id=None, eos_token_id=1, pad_token_id=None,
        attn_implementation="eager",
    )


def qwen3_config():
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        initializer_range=0.2, bos_token_id=0, eos_token_id=4, pad_token_id=None,
        attn_implementation="eager",
    )


def smollm3_config():
    # no_rope_layers [1, 1, 1, 0]: HF's default interval, llama.cpp's rule.
    return SmolLM3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        no_rope_layer_interval=4, rope_theta=2000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, initializer_range=0.2, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, attn_implementation="eager",
    )


def olmo2_config():
    return Olmo2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=1, pad_token_id=None, attn_implementation="eager",
    )


def gemma2_config():
    # What a gemma2 file can say: scores scaled by head_dim^-1/2 (llama.cpp's
    # rule but for the 27B's 46 layers), sliding layers alternating from the
    # first (its default pattern, 2), soft-caps small enough to bend these
    # scores and logits, a window shorter than the prompt; rope_theta 10000,
    # since the converter writes no rope base for Gemma 2 and llama.cpp takes
    # 10000.
    return Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=4,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0, tie_word_embeddings=True,
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        attn_implementation="eager",
    )


def gemma3_config():
    # Six layers, the last full (llama.cpp's default pattern, 6), with their
    # own rope bases (rope.freq_base, rope.freq_base_swa); untied.
    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=4,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0}},
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, attn_implementation="eager",
    )


def llama256_config():
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, initializer_range=0.05, bos_token_id=0, eos_token_id=[1, 4],
        pad_token_id=None, attn_implementation="eager",
    )


# name: (config, class, llama.cpp pre-tokenizer, GGUF types)
MODELS = {
    "llama": (llama_config, LlamaForCausalLM, "gpt-2", ["f32", "f16", "bf16", "q8_0"]),
    "qwen2": (qwen2_config, Qwen2ForCausalLM, "qwen2", ["f32", "q8_0"]),
    "qwen3": (qwen3_config, Qwen3ForCausalLM, "llama-bpe", ["f32", "bf16"]),
}

# The same for llama.cpp's architectures `smollm3`, `olmo2`, `gemma2` and
# `gemma3`, whose HF names are the model_type (Gemma 3's `gemma3_text`).
ARCHS = {
    "smollm3": (smollm3_config, SmolLM3ForCausalLM, "llama-bpe", ["f32"]),
    "olmo2": (olmo2_config, Olmo2ForCausalLM, "gpt-2", ["f32"]),
    "gemma2": (gemma2_config, Gemma2ForCausalLM, "gpt-2", ["f32", "q8_0"]),
    "gemma3": (gemma3_config, Gemma3ForCausalLM, "llama-bpe", ["f32"]),
}

# name: (config, class, llama.cpp pre-tokenizer, llama-quantize types): each
# file quantized by llama-quantize from the converter's f32 one.
QUANTIZED = {
    "llama256": (llama256_config, LlamaForCausalLM, "gpt-2", ["q4_0", "q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k"]),
}

# name: GGUF types converted from tests/fixtures/decoders/{name}, whose
# oracle is that folder's {name}_expected.safetensors.
FROM_DECODERS = {
    "phi3": ["f32"],
}
DECODERS = os.path.join(ROOT, "tests", "fixtures", "decoders")

# HF parameter names to the converter's (gguf-py's tensor map for these archs).
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# OLMo 2's norms follow attention and MLP: gguf-py's map for arch `olmo2`
# takes `post_attention_layernorm` to ATTN_POST_NORM, not FFN_NORM.
OLMO2_LAYER_TO_GGUF = {
    **LAYER_TO_GGUF,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


# Phi-3's fused projections (arch phi3).
PHI3_LAYER_TO_GGUF = {
    **LAYER_TO_GGUF,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}

# Gemma's four norms a block: gguf-py's map for archs `gemma2` and `gemma3`
# takes `pre_feedforward_layernorm` to FFN_PRE_NORM, which is `ffn_norm`.
GEMMA_LAYER_TO_GGUF = {
    **OLMO2_LAYER_TO_GGUF,
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
}

LAYER_MAPS = {"olmo2": OLMO2_LAYER_TO_GGUF, "phi3": PHI3_LAYER_TO_GGUF, "gemma2": GEMMA_LAYER_TO_GGUF,
              "gemma3_text": GEMMA_LAYER_TO_GGUF}


def gguf_name(hf, model_type="llama"):
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    layer = LAYER_MAPS.get(model_type, LAYER_TO_GGUF)
    return f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"


def byte_level_tokenizer(folder, vocab_size):
    """A byte-level BPE tokenizer of GPT-2's first `vocab_size` byte symbols, no merges."""
    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the
    # others for the code points from 256 on, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)][:vocab_size]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                            "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {c: i for i, c in enumerate(symbols)}, "merges": []},
    }
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "clean_up_tokenization_spaces": False}, f)


def build_from_decoder(name, llama_cpp, tmp):
    """tests/fixtures/decoders/{name} converted to each of FROM_DECODERS[name]'s types, checked."""
    from safetensors.torch import load_file

    folder = os.path.join(tmp, name)
    shutil.copytree(os.path.join(DECODERS, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    byte_level_tokenizer(folder, config["vocab_size"])
    weights = load_file(os.path.join(folder, "model.safetensors"))
    files = {}
    for outtype in FROM_DECODERS[name]:
        path = os.path.join(tmp, f"{name}-{outtype}.gguf")
        convert(llama_cpp, folder, outtype, path, "gpt-2")
        tensors, fields = read_gguf(path)
        assert fields["general.architecture"] == name, fields["general.architecture"]
        rope = config["rope_parameters"]
        factors = {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}
        params = {gguf_name(n, name) for n in weights}
        assert set(tensors) == params | set(factors), sorted(set(tensors) ^ (params | set(factors)))
        for n, w in weights.items():
            kind, t = tensors[gguf_name(n, name)]
            assert kind == "F32" and np.array_equal(np.asarray(t.data).reshape(tuple(w.shape)), w.numpy()), n
        for n, want in factors.items():
            assert np.array_equal(np.asarray(tensors[n][1].data), np.array(want, dtype=np.float32)), n
        assert fields[f"{name}.rope.scaling.original_context_length"] == config["original_max_position_embeddings"]
        files[outtype] = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
                          "metadata": {k: v for k, v in fields.items() if k.startswith(f"{name}.")}}
    return files


def rename(tok, old, new):
    """Renames the special token `old` of tokenizer.json `tok`."""
    for t in tok["added_tokens"]:
        if t["content"] == old:
            t["content"] = new
    tok["model"]["vocab"][new] = tok["model"]["vocab"].pop(old)


def write_tokenizer(folder, pre):
    """tests/fixtures/text/llama3's tokenizer with the pre-tokenizer `pre` names."""
    with open(os.path.join(TOKENIZER, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(TOKENIZER, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert len(tok["model"]["vocab"]) + 0 <= VOCAB
    assert tok["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                    "use_regex": True}, tok["pre_tokenizer"]
    split = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    if pre == "gpt-2":
        pass  # GPT-2's regex inside ByteLevel, as the file has it.
    elif pre == "llama-bpe":
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            split]}
        tok["model"]["ignore_merges"] = True
    elif pre == "qwen2":
        tok["normalizer"] = {"type": "NFC"}
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
            split]}
        # No BOS: Qwen2 adds no special token.
        tok["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                 "use_regex": False}
        config.pop("bos_token", None)
        # Qwen2's end token by its name: transformers' Qwen2Tokenizer adds
        # `<|endoftext|>` (its unk, eos and pad) when the vocabulary lacks it.
        rename(tok, "<|end_of_text|>", "<|endoftext|>")
        config["eos_token"] = "<|endoftext|>"
    else:
        raise ValueError(pre)
    # transformers 5 never cleans up a BPE tokenizer's spaces.
    config["clean_up_tokenization_spaces"] = False
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)


def randomize_norms_and_biases(model):
    """HF initialises norm weights to one (Gemma's, which scale by 1 + w, to zero) and biases to
    zero; make them non-trivial."""
    one = 0.0 if model.config.model_type in ("gemma2", "gemma3_text") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(one + 0.2 * torch.randn_like(p))


def config_summary(model):
    return {k: v for k, v in model.config.to_dict().items()
            if k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_hidden_layers", "intermediate_size", "vocab_size", "tie_word_embeddings",
                     "attention_bias", "rope_theta", "rms_norm_eps", "rope_parameters", "no_rope_layers",
                     "query_pre_attn_scalar", "sliding_window", "layer_types", "attn_logit_softcapping",
                     "final_logit_softcapping")}


def margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def convert(llama_cpp, folder, outtype, outfile, pre):
    """Runs convert_hf_to_gguf.py's main() in this process, its pre-tokenizer hash check answered."""
    from conversion import base, gemma

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    # Gemma 2's converter reads only a SentencePiece tokenizer.model; these
    # folders have the byte-level BPE tokenizer.json the others have, which
    # Gemma 3's reads (`_set_vocab_gpt2` where there is no tokenizer.model).
    gemma.Gemma2Model.set_vocab = gemma.Gemma3Model.set_vocab
    import convert_hf_to_gguf

    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


def read_gguf(path):
    """{tensor name: (ggml type name, numpy data)} and {key: value} of a GGUF file, by gguf-py."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, t) for t in reader.tensors}
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        fields[name] = field.contents()
    return tensors, fields


def rounded_model(model, tensors):
    """A copy of `model` with each weight rounded as its GGUF tensor stores it."""
    import gguf

    out = copy.deepcopy(model)
    kinds = {}
    with torch.no_grad():
        for name, p in out.named_parameters():
            kind = tensors[gguf_name(name, model.config.model_type)][0]
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "F32":
                continue
            qtype = gguf.GGMLQuantizationType[kind]
            w = p.detach().numpy().astype(np.float32)
            if kind == "F16":
                back = w.astype(np.float16).astype(np.float32)
            else:
                back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(p.shape))
    return out, kinds


def eos_ids(fields):
    """The end tokens a GGUF names: eos, then eot and eom where given."""
    ids = []
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]:
        if key in fields and int(fields[key]) not in ids:
            ids.append(int(fields[key]))
    return ids


def sample(name, make_config, cls, pre, tmp):
    """The first seed's model whose greedy steps all clear MIN_MARGIN, saved with its tokenizer.

    Returns (folder, tokenizer, prompts, input_ids, model, its logits, seed, seeds rejected).
    """
    folder = os.path.join(tmp, name)
    os.makedirs(folder)
    write_tokenizer(folder, pre)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        prompts.append({"text": text, "ids": ids,
                        "decoded": tokenizer.decode(ids, skip_special_tokens=True)})
    input_ids = torch.tensor([prompts[1]["ids"]])

    tried = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        model = cls(make_config())
        randomize_norms_and_biases(model)
        model = model.float().eval()
        # Every prompt's greedy steps (without end tokens: a continuation
        # that ends early is a prefix of these) and the prompt's positions.
        with torch.no_grad():
            logits = model(input_ids).logits.float()
            m = margins(logits).min().item()
            for p in prompts:
                ids = torch.tensor([p["ids"]])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     min_new_tokens=MAX_NEW, do_sample=False, num_beams=1, eos_token_id=None,
                                     pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                m = min(m, margins(torch.stack(out.logits, 1)).min().item())
        if m >= MIN_MARGIN:
            break
        tried.append((seed, m))
    else:
        sys.exit(f"{name}: no seed in {SEEDS} gives a margin >= {MIN_MARGIN}: {tried}")
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    return folder, tokenizer, prompts, input_ids, model, logits, seed, tried


def greedy(model, tokenizer, ids, eos, steps=False):
    """HF's greedy continuation of `ids` (1, T), ending at the end tokens `eos`.

    With `steps`, also each step's top-2 margin (`margins`).
    """
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                             do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=eos[0],
                             output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    finish = "eos" if new and new[-1] in eos else "length"
    if finish == "eos":
        new = new[:-1]
    step_margins = margins(torch.stack(out.logits, 1))[0]
    result = {"ids": new, "text": tokenizer.decode(new, skip_special_tokens=True), "finish": finish,
              "min_margin": step_margins.min().item()}
    if steps:
        result["margins"] = step_margins.tolist()
    return result


def build(name, spec, llama_cpp, tmp):
    make_config, cls, pre, types = spec
    folder, tokenizer, prompts, input_ids, model, logits, seed, tried = sample(name, make_config, cls, pre, tmp)

    tensors_out = {f"{name}.input_ids": input_ids.int()}
    files = {}
    eos = None
    for outtype in types:
        path = os.path.join(tmp, f"{name}-{outtype}.gguf")
        convert(llama_cpp, folder, outtype, path, pre)
        tensors, fields = read_gguf(path)
        assert fields["general.architecture"] == name, fields["general.architecture"]
        assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == pre
        # The oracle rounds exactly what the converter rounded: every tensor
        # is one of the model's parameters.
        params = {gguf_name(n, model.config.model_type) for n, _ in model.named_parameters()}
        assert set(tensors) == params, sorted(set(tensors) ^ params)
        rounded, kinds = rounded_model(model, tensors)
        with torch.no_grad():
            tensors_out[f"{name}.{outtype}.logits"] = rounded(input_ids).logits.float()
        if outtype == "f32":
            assert torch.equal(tensors_out[f"{name}.f32.logits"], logits), name
        file_eos = eos_ids(fields)
        assert eos is None or eos == file_eos
        eos = file_eos
        files[outtype] = {"file": os.path.basename(path), "bytes": os.path.getsize(path), "tensor_types": kinds,
                          "max_rel_error_vs_f32": (
                              (tensors_out[f"{name}.{outtype}.logits"] - logits).abs().max()
                              / logits.abs().max()).item()}

    # HF's greedy continuation of each prompt, ending at the file's end tokens.
    for p in prompts:
        p["greedy"] = greedy(model, tokenizer, torch.tensor([p["ids"]]), eos)
        assert p["greedy"]["min_margin"] >= MIN_MARGIN, (name, p)

    case = {
        "model": cls.__name__,
        "config": config_summary(model),
        "seed": seed,
        "init": "config initializer_range 0.2; then every bias ~ 0.1*N(0,1), every norm weight ~ 1+0.2*N(0,1) "
            "(Gemma's, which scale by 1 + w: 0.2*N(0,1))",
        "pre_tokenizer": pre,
        "eos_token_ids": eos,
        "files": files,
        "prompts": prompts,
        "input_ids": "prompts[1]'s ids",
        "logits": "{name}.{type}.logits: HF's model(input_ids).logits with each weight rounded to its GGUF "
                  "tensor's type (gguf-py quantize + dequantize), computed in float32 (f32: the "
                  "float32 model's own)",
        "greedy": "generate(ids, max_new_tokens=%d, do_sample=False, eos_token_id=eos_token_ids): the new ids, "
                  "the end token dropped, decoded with skip_special_tokens" % MAX_NEW,
    }
    if tried:
        case["seeds_rejected"] = tried
    return tensors_out, case


def llama_quantize(exe, src, dst, qtype):
    """`llama-quantize src dst QTYPE 1` (one thread); returns the version it prints."""
    out = subprocess.run([exe, src, dst, qtype.upper(), "1"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{exe} {qtype} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    version = re.search(r"^version: (.+)$", out.stdout + out.stderr, re.M)
    return version.group(1).strip() if version else "unknown"


def unpermute(w, n_head):
    """Undoes the converter's `LlamaModel.permute(w, _, n_head)` of q or k rows (conversion/llama.py)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored_model(model, tensors):
    """A copy of `model` with each weight gguf-py's `dequantize` of the tensor the file stores.

    q and k are un-permuted back to HF's row order (blocks run along a row, and
    the permutation moves whole rows, so this is exact).
    """
    import gguf

    cfg = model.config
    out = copy.deepcopy(model)
    kinds, by_name = {}, {}
    with torch.no_grad():
        for name, p in out.named_parameters():
            kind, t = tensors[gguf_name(name)]
            kinds[kind] = kinds.get(kind, 0) + 1
            by_name[gguf_name(name)] = kind
            w = np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
            w = w.reshape(tuple(p.shape))
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute(w, cfg.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute(w, cfg.num_key_value_heads)
            p.copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return out, kinds, dict(sorted(by_name.items()))


def build_quantized(name, llama_cpp, quantize_exe, tmp):
    make_config, cls, pre, types = QUANTIZED[name]
    folder, tokenizer, prompts, input_ids, model, logits, seed, tried = sample(name, make_config, cls, pre, tmp)

    f32 = os.path.join(tmp, f"{name}-f32.gguf")
    convert(llama_cpp, folder, "f32", f32, pre)
    tensors, fields = read_gguf(f32)
    assert fields["general.architecture"] == "llama", fields["general.architecture"]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == pre
    params = {gguf_name(n) for n, _ in model.named_parameters()}
    assert set(tensors) == params, sorted(set(tensors) ^ params)
    # Read back from the f32 file, every weight is HF's: the un-permutation
    # is the converter's permutation undone.
    back, _, _ = stored_model(model, tensors)
    for (n, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), n
    eos = eos_ids(fields)

    for p in prompts:
        p["greedy"] = greedy(model, tokenizer, torch.tensor([p["ids"]]), eos, steps=True)
        assert p["greedy"]["min_margin"] >= MIN_MARGIN, (name, p)
        p["greedy_by_type"] = {}

    tensors_out = {f"{name}.input_ids": input_ids.int()}
    files = {}
    version = None
    for qtype in types:
        path = os.path.join(tmp, f"{name}-{qtype}.gguf")
        version = llama_quantize(quantize_exe, f32, path, qtype)
        tensors, qfields = read_gguf(path)
        assert set(tensors) == params, sorted(set(tensors) ^ params)
        assert eos_ids(qfields) == eos
        stored, kinds, by_name = stored_model(model, tensors)
        with torch.no_grad():
            tensors_out[f"{name}.{qtype}.logits"] = stored(input_ids).logits.float()
        files[qtype] = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
                        "file_type": int(qfields["general.file_type"]), "tensor_types": kinds,
                        "tensor_type_of": by_name,
                        "max_rel_error_vs_f32": (
                            (tensors_out[f"{name}.{qtype}.logits"] - logits).abs().max()
                            / logits.abs().max()).item()}
        for p in prompts:
            p["greedy_by_type"][qtype] = greedy(stored, tokenizer, torch.tensor([p["ids"]]), eos, steps=True)
    os.remove(f32)

    case = {
        "model": cls.__name__,
        "config": {**config_summary(model), "initializer_range": model.config.initializer_range},
        "seed": seed,
        "init": "config initializer_range; then every norm weight ~ 1+0.2*N(0,1) (no biases)",
        "pre_tokenizer": pre,
        "eos_token_ids": eos,
        "files": files,
        "llama_quantize": f"llama-quantize F32_FILE OUT TYPE 1 (no imatrix), version {version}",
        "prompts": prompts,
        "input_ids": "prompts[1]'s ids",
        "logits": "{name}.{type}.logits: HF's model(input_ids).logits with every weight replaced by gguf-py's "
                  "dequantize of the tensor the file stores (q/k un-permuted), computed in float32",
        "greedy": "generate(ids, max_new_tokens=%d, do_sample=False, eos_token_id=eos_token_ids): the new ids, "
                  "the end token dropped, decoded with skip_special_tokens, each step's top-2 margin; greedy: the "
                  "float32 model's, greedy_by_type: each file's weights'" % MAX_NEW,
    }
    if tried:
        case["seeds_rejected"] = tried
    return tensors_out, case


# Each expected file and the models whose values it holds.
GROUPS = {
    "expected.safetensors": MODELS,
    "expected-archs.safetensors": ARCHS,
    "expected-quantized.safetensors": QUANTIZED,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                        help="llama.cpp's source tree (convert_hf_to_gguf.py, conversion/, gguf-py/)")
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary "
                        "(default: LLAMA_CPP/build/bin/llama-quantize)")
    parser.add_argument("--only", action="append", choices=list(GROUPS) + sorted(FROM_DECODERS),
                        help="remake only this group's files, named by its expected file, or only the file "
                        "converted from tests/fixtures/decoders/NAME (repeatable)")
    args = parser.parse_args()
    groups = [g for g in args.only or GROUPS if g in GROUPS]
    decoders = [d for d in args.only or FROM_DECODERS if d in FROM_DECODERS]
    if not args.llama_cpp or not os.path.isfile(os.path.join(args.llama_cpp, "convert_hf_to_gguf.py")):
        sys.exit("--llama-cpp (or LLAMA_CPP_DIR) must name llama.cpp's source tree")
    llama_cpp = os.path.abspath(args.llama_cpp)
    quantize_exe = os.path.abspath(args.llama_quantize or os.path.join(llama_cpp, "build", "bin", "llama-quantize"))
    if "expected-quantized.safetensors" in groups and not os.access(quantize_exe, os.X_OK):
        sys.exit(f"no llama-quantize at {quantize_exe}: build it (cmake --build build --target llama-quantize) "
                 "or name it with --llama-quantize")
    sys.path.insert(0, llama_cpp)
    sys.path.insert(1, os.path.join(llama_cpp, "gguf-py"))

    parent = os.path.dirname(os.path.abspath(OUT))
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=parent)
    try:
        import gguf

        versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "gguf_py": getattr(gguf, "__version__", "vendored")}
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        for name in decoders:
            for t, f in build_from_decoder(name, llama_cpp, tmp).items():
                shutil.move(os.path.join(tmp, f["file"]), os.path.join(out, f["file"]))
                print(f"{name} {t}: {f['bytes']} bytes, {f['metadata']}")
        builders = {
            "expected.safetensors": lambda name: build(name, MODELS[name], llama_cpp, tmp),
            "expected-archs.safetensors": lambda name: build(name, ARCHS[name], llama_cpp, tmp),
            "expected-quantized.safetensors": lambda name: build_quantized(name, llama_cpp, quantize_exe, tmp),
        }
        all_cases = {}
        for expected in groups:
            tensors, cases = {}, {}
            for name in GROUPS[expected]:
                t, case = builders[expected](name)
                tensors.update(t)
                cases[name] = case
            for name, case in cases.items():
                for f in case["files"].values():
                    shutil.move(os.path.join(tmp, f["file"]), os.path.join(out, f["file"]))
            meta = {"models": cases, **versions}
            save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                      os.path.join(out, expected), metadata={"case": json.dumps(meta, ensure_ascii=False)})
            all_cases.update(cases)
        # Only the files made here are replaced: README.md and vocab/ stay.
        os.makedirs(OUT, exist_ok=True)
        for f in sorted(os.listdir(out)):
            os.replace(os.path.join(out, f), os.path.join(OUT, f))
        for name, case in all_cases.items():
            for t, f in case["files"].items():
                print(f"{name} {t}: {f['bytes']} bytes, {f['tensor_types']}, "
                      f"max rel error vs f32 {f['max_rel_error_vs_f32']:.2e}")
            print(f"{name}: eos {case['eos_token_ids']}, greedy {[p['greedy']['ids'] for p in case['prompts']]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
