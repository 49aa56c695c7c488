#!/usr/bin/env python3
"""Write the PyTorch / Hugging Face fixtures for the GPT-2 and Llama decoders' tests.

Everything lands in tests/fixtures/decoders/:

* `gpt2/`, `llama/`: a tiny random-init `GPT2LMHeadModel` / `LlamaForCausalLM`
  (float32), saved with `save_pretrained(dir, safe_serialization=True)` and
  kept exactly as HF writes it (`config.json`, `model.safetensors`, and
  `generation_config.json` if HF writes one). GPT-2's lm_head is tied to
  `transformer.wte.weight`, so HF omits `lm_head.weight`; Llama's is not tied.
* `gpt2_expected.safetensors`, `llama_expected.safetensors`: the prompts, the
  full-prompt logits, greedy generation and the logits of every generated
  step, plus a left-padded batch (see `decoder_case`). The description is a
  JSON string in the metadata under "case", the only metadata key (so the
  files are byte-reproducible), with the torch / transformers versions.
* `rotary.safetensors`: HF's own rotary functions applied to random q / k at
  positions OFFSET..OFFSET+T, in the half-split (Llama), partial half-split
  (GPT-NeoX) and interleaved (GPT-J) forms.

The weights use a large init (`initializer_range` 0.2, and every norm weight
and bias randomised too) so the logits are peaked: at every greedy step the
top-1 logit must beat the runner-up by at least MIN_MARGIN, else the next
seed is tried (and the script fails if none works). Expectations are computed
in eval mode with `attn_implementation="eager"`; each saved folder is then
reloaded with `from_pretrained` and must give the same logits bit for bit.

Everything is written into a temporary folder next to the output, which
replaces tests/fixtures/decoders only when all of it succeeded.

Regenerate (the venv of scripts/requirements.txt; offline, a few seconds):

    .venv-ref/bin/python scripts/make_decoder_fixtures.py
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "decoders")

VOCAB = 128
BATCH, PROMPT = 2, 7
SHORT = 4  # real tokens in the left-padded row
MAX_NEW = 10
PAD = 0
MIN_MARGIN = 1e-2
SEEDS = range(100)
VERSIONS = {"torch": torch.__version__, "transformers": transformers.__version__}


def gpt2_config():
    return GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager",
    )


def llama_config():
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=50000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation="eager",
    )


def mistral_config():
    # A window of 4 keys: shorter than the 7-token prompt, so it shapes
    # every logit after the fourth position.
    return MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128, sliding_window=4,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )


def llama3_config():
    # Llama 3.1's rope scaling with a short original context (32), so that
    # the 8 frequencies of a 16-wide head fall in all three bands (kept,
    # blended, divided by the factor).
    cfg = llama_config()
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}
    return cfg


def qwen2_config():
    # Qwen2: biases on q, k, v only; a sliding_window value that
    # use_sliding_window=False switches off.
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=4, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation="eager",
    )


def qwen3_config():
    # Qwen3: an RMSNorm on each head of q and k, and heads wider than
    # hidden / heads (head_dim 32 with hidden 64 and 4 heads: q is 128 wide).
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager",
    )


def smollm3_config():
    # SmolLM3: Llama with layers that have no rotary. The real models drop
    # it on every fourth layer; here layer 0 has none (no_rope_layers [0, 1],
    # a pattern the default interval cannot give), in 2 layers like the
    # other fixtures. rope_theta 2e6, tied lm_head.
    return SmolLM3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, no_rope_layers=[0, 1],
        rope_theta=2000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="eager",
    )


def olmo2_config():
    # OLMo 2: RMSNorms after the attention and the MLP (none before), and on
    # q and k over all heads' features at once (q_norm 64 wide, k_norm 32).
    return Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )


def phi3_config():
    # Phi-3: fused qkv_proj and gate_up_proj; Phi-4-mini's partial rotary
    # (0.75 of each 16-wide head: 12 dims, 6 pairs) and LongRoPE with its
    # own short and long factors. The original context is 2, so that every
    # prompt (and the chunked prefill's first chunk of 3) already reaches
    # past it: the whole fixture runs on long_factor, as HF does once a
    # sequence passes it; `short_logits` covers short_factor. HF's
    # attention factor comes from max_position_embeddings / original:
    # sqrt(1 + ln(2) / ln(2)) = sqrt(2) (Phi-3.5-mini's is 1.19; a larger
    # one makes the logits too sensitive for the bf16 tests). A sliding
    # window of 5 keys, as Phi-3-mini's 2047, which HF's model masks with.
    head = 16
    pairs = int(head * 0.75) // 2
    return Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4,
        original_max_position_embeddings=PHI3_ORIGINAL, partial_rotary_factor=0.75, sliding_window=5,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.5 * i * i for i in range(pairs)],
        },
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )


PHI3_ORIGINAL = 2


def gemma2_config():
    # Gemma 2: sandwich norms, (1 + w) RMSNorms, embeddings times
    # sqrt(hidden), GeGLU, query_pre_attn_scalar in place of head_dim,
    # soft-capped scores and logits, sliding (layer 0) and full (layer 1)
    # attention by the default alternation. head_dim 32 with hidden 64 and
    # 4 heads; caps small enough to bite on these logits; a window of 4
    # keys, shorter than the prompt. initializer_range 0.1, not 0.2: at 0.2
    # rounding the weights to bf16 moves these logits by 3 % of the
    # largest, past what the half-precision tests allow any model.
    return Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=4,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation="eager",
    )


def gemma3_config():
    # Gemma 3 (text): Gemma 2's blocks with RMSNorms (1 + w) on each head of
    # q and k, no soft-capping, and a rope base per layer kind: sliding
    # layers at 10k, full ones at 1M with linear scaling (factor 8, as
    # the 4B and larger have). Layer 0 sliding (window 4), layer 1 full.
    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )


MODELS = {
    "gpt2": (gpt2_config, GPT2LMHeadModel),
    "llama": (llama_config, LlamaForCausalLM),
    "mistral": (mistral_config, MistralForCausalLM),
    "llama3": (llama3_config, LlamaForCausalLM),
    "qwen2": (qwen2_config, Qwen2ForCausalLM),
    "qwen3": (qwen3_config, Qwen3ForCausalLM),
    "smollm3": (smollm3_config, SmolLM3ForCausalLM),
    "olmo2": (olmo2_config, Olmo2ForCausalLM),
    "phi3": (phi3_config, Phi3ForCausalLM),
    "gemma2": (gemma2_config, Gemma2ForCausalLM),
    "gemma3": (gemma3_config, Gemma3ForCausalLM),
}


def randomize_norms_and_biases(model):
    """HF initialises norm weights to one and biases to zero; make them non-trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "ln" in name or "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


def generate(model, ids, mask=None):
    """Greedy decoding, MAX_NEW tokens, no EOS: (sequences (B, P+MAX_NEW), step logits (B, MAX_NEW, V))."""
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, num_beams=1,
        pad_token_id=PAD, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
        use_cache=True,
    )
    seq = out.sequences
    logits = torch.stack(out.logits, dim=1).float()
    assert seq.shape == (ids.shape[0], ids.shape[1] + MAX_NEW), seq.shape
    assert logits.shape == (ids.shape[0], MAX_NEW, VOCAB), logits.shape
    # Greedy means each new token is the arg-max of its step's logits.
    assert torch.equal(seq[:, ids.shape[1]:], logits.argmax(-1)), "generate is not greedy over its logits"
    return seq, logits


def margins(logits):
    """Top-1 minus runner-up at every (row, step)."""
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def try_seed(name, seed):
    make_config, cls = MODELS[name]
    torch.manual_seed(seed)
    model = cls(make_config())
    randomize_norms_and_biases(model)
    model = model.float().eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation

    g = torch.Generator().manual_seed(1000 + seed)
    # Real tokens are 1..VOCAB-1: 0 is the pad id.
    input_ids = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=g)
    short = torch.randint(1, VOCAB, (1, SHORT), generator=g)
    padded_ids = torch.cat([input_ids[:1], torch.cat([torch.full((1, PROMPT - SHORT), PAD), short], 1)], 0)
    padded_mask = (torch.arange(PROMPT)[None, :] >= torch.tensor([0, PROMPT - SHORT])[:, None]).long()
    # What generate builds from the mask for models whose forward takes position_ids.
    padded_pos = (padded_mask.cumsum(-1) - 1).masked_fill(padded_mask == 0, 0)

    with torch.no_grad():
        logits = model(input_ids).logits.float()
        greedy, step = generate(model, input_ids)
        p_greedy, p_step = generate(model, padded_ids, padded_mask)
        s_greedy, s_step = generate(model, short)

    m = torch.cat([margins(step).flatten(), margins(p_step).flatten(), margins(s_step).flatten()])
    if m.min().item() < MIN_MARGIN:
        return None, m.min().item()

    same_tokens = torch.equal(p_greedy[1, PROMPT - SHORT:], s_greedy[0])
    logit_diff = (p_step[1] - s_step[0]).abs().max().item()
    # Row 0 of the padded batch is unpadded; it should agree with row 0 of the plain batch.
    row0_same = torch.equal(p_greedy[0], greedy[0])
    row0_diff = (p_step[0] - step[0]).abs().max().item()
    tensors = {
        "input_ids": input_ids, "logits": logits, "greedy_ids": greedy, "step_logits": step,
        "padded_ids": padded_ids, "padded_attention_mask": padded_mask,
        "padded_position_ids": padded_pos, "padded_greedy_ids": p_greedy,
        "padded_step_logits": p_step,
    }
    extra = {}
    if name == "phi3":
        # LongRoPE's short factors: a call whose positions stay within the
        # original context. And what HF's generate does when a cached
        # sequence first passes it: the cache dropped, the whole sequence
        # recomputed on long_factor (Phi3ForCausalLM.prepare_inputs_for_generation).
        with torch.no_grad():
            short_ids = input_ids[:, :PHI3_ORIGINAL]
            tensors["short_logits"] = model(short_ids).logits.float()
            g = model.generate(short_ids[:, :1], attention_mask=torch.ones_like(short_ids[:, :1]),
                               max_new_tokens=3, min_new_tokens=3, do_sample=False, num_beams=1,
                               pad_token_id=PAD, eos_token_id=None, output_logits=True,
                               return_dict_in_generate=True, use_cache=True)
            crossing = torch.stack(g.logits, dim=1).float()
            full = model(g.sequences[:, :-1]).logits.float()[:, -3:]
        assert torch.equal(crossing[:, -1].argmax(-1), full[:, -1].argmax(-1))
        extra = {
            "short_logits": "model(input_ids[:, :%d]).logits: positions within original_max_position_embeddings "
                            "(%d), so short_factor" % (PHI3_ORIGINAL, PHI3_ORIGINAL),
            "crossing": "generate from 1 token, 3 steps: the step reaching past the original context recomputes "
                        "the whole sequence on long_factor; its logits equal a full pass's within %.2g" % (
                            (crossing[:, -1] - full[:, -1]).abs().max().item()),
        }
    case = {
        "model": cls.__name__,
        "config_dir": name,
        "seed": seed,
        "dtype": "float32",
        "attn_implementation": "eager",
        "init": "config initializer_range %s; then every bias ~ 0.1*N(0,1), every norm weight ~ 1+0.2*N(0,1)" % model.config.initializer_range,
        "max_new_tokens": MAX_NEW,
        "generate_kwargs": {
            "max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "do_sample": False, "num_beams": 1,
            "pad_token_id": PAD, "eos_token_id": None, "use_cache": True,
            "output_logits": True, "return_dict_in_generate": True,
        },
        "eos_token_id": None,
        "pad_token_id": PAD,
        "prompt_tokens": "uniform in 1..%d (0 is the pad id)" % (VOCAB - 1),
        "logits": "model(input_ids).logits, eval mode, no mask, positions 0..6",
        "greedy_ids": "generate(input_ids, attention_mask=ones): prompt then %d greedy tokens" % MAX_NEW,
        "step_logits": "generate(...).logits stacked: step_logits[:, i] are the logits that chose greedy_ids[:, 7+i]",
        "padded": {
            "rows": "row 0 = input_ids[0] (no padding); row 1 = %d pads (id %d) then %d real tokens" % (
                PROMPT - SHORT, PAD, SHORT),
            "real_tokens_row1": SHORT,
            "attention_mask": "padded_attention_mask, 0 on pads, passed to generate",
            "position_ids": "padded_position_ids = (cumsum(mask)-1).masked_fill(mask==0, 0), as generate builds "
                            "them for the prompt; decode steps continue from the last (+1 per step). "
                            "GPT-2 needs them (learned absolute wpe: with the default 0..6 row 1's logits "
                            "change); for Llama RoPE is shift-invariant so they only matter to float rounding",
            "row1_equals_unpadded_tokens": same_tokens,
            "row1_max_abs_step_logit_diff_vs_unpadded": logit_diff,
            "row0_equals_plain_batch_tokens": row0_same,
            "row0_max_abs_step_logit_diff_vs_plain_batch": row0_diff,
        },
        **extra,
        "greedy_min_margin": {
            "plain": margins(step).min().item(),
            "padded": margins(p_step).min().item(),
            "short_alone": margins(s_step).min().item(),
            "required": MIN_MARGIN,
        },
        **VERSIONS,
    }
    return (model, tensors, case), m.min().item()


def gemma3_multimodal(tmp):
    """`gemma3_mm/`: a `Gemma3ForConditionalGeneration` whose text model is
    `gemma3/`'s (its weights copied) beside a one-layer SigLIP tower, as
    `save_pretrained` writes it (the text under `language_model.`). Its
    text-only logits must equal `gemma3/`'s, so the tests reuse
    `gemma3_expected.safetensors`."""
    text = Gemma3ForCausalLM.from_pretrained(os.path.join(tmp, "gemma3"), attn_implementation="eager",
                                             dtype=torch.float32).eval()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                       attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    missing, unexpected = model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    assert not missing and not unexpected
    folder = os.path.join(tmp, "gemma3_mm")
    model.save_pretrained(folder, safe_serialization=True)
    expected = load_file(os.path.join(tmp, "gemma3_expected.safetensors"))
    again = Gemma3ForConditionalGeneration.from_pretrained(folder, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        logits = again(expected["input_ids"].long()).logits.float()
    diff = (logits - expected["logits"]).abs().max().item()
    assert diff < 1e-5, f"gemma3_mm: text logits differ from gemma3's by {diff}"
    return sorted(os.listdir(folder))


def build_decoder(name, tmp):
    tried = []
    for seed in SEEDS:
        result, margin = try_seed(name, seed)
        if result is not None:
            break
        tried.append((seed, margin))
    else:
        sys.exit(f"{name}: no seed in {SEEDS} gives a greedy margin >= {MIN_MARGIN}: {tried}")
    model, tensors, case = result
    if tried:
        case["seeds_rejected"] = tried

    folder = os.path.join(tmp, name)
    model.save_pretrained(folder, safe_serialization=True)
    # Reload as HF would and check the logits bit for bit.
    reloaded = MODELS[name][1].from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    assert reloaded.dtype == torch.float32
    with torch.no_grad():
        again = reloaded(tensors["input_ids"]).logits
        r_greedy, r_step = generate(reloaded, tensors["input_ids"])
    assert torch.equal(again, tensors["logits"]), f"{name}: reloaded logits differ"
    assert torch.equal(r_greedy, tensors["greedy_ids"]) and torch.equal(r_step, tensors["step_logits"]), name

    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(tmp, f"{name}_expected.safetensors"),
              metadata={"case": json.dumps(case)})
    return case, sorted(os.listdir(folder))


def rotary(tmp):
    """HF's rotary functions on random q, k (1, H, T, D) at positions OFFSET..OFFSET+T."""
    H, T, D, OFFSET = 2, 6, 16, 5
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, H, T, D, generator=g)
    k = torch.randn(1, H, T, D, generator=g)
    positions = torch.arange(OFFSET, OFFSET + T)
    position_ids = positions[None, :]

    # Half-split over the whole head (Llama / GPT-NeoX rotate_half), non-default theta.
    llama_theta = 500000.0
    lcfg = LlamaConfig(hidden_size=H * D * 2, num_attention_heads=2 * H, rope_theta=llama_theta,
                       max_position_embeddings=128)
    assert lcfg.hidden_size // lcfg.num_attention_heads == D
    assert lcfg.rope_parameters["rope_theta"] == llama_theta, lcfg.rope_parameters
    rope = modeling_llama.LlamaRotaryEmbedding(lcfg)
    cos_half, sin_half = rope(q, position_ids)
    assert cos_half.shape == (1, T, D), cos_half.shape
    q_half, k_half = modeling_llama.apply_rotary_pos_emb(q, k, cos_half, sin_half)

    # Partial half-split (GPT-NeoX rotary_pct 0.5): first 8 dims rotated, the rest passed through.
    neox_theta, neox_pct = 10000.0, 0.5
    ncfg = GPTNeoXConfig(hidden_size=H * D * 2, num_attention_heads=2 * H, rotary_pct=neox_pct,
                         rotary_emb_base=neox_theta, max_position_embeddings=128)
    assert ncfg.rope_parameters["partial_rotary_factor"] == neox_pct, ncfg.rope_parameters
    assert ncfg.rope_parameters["rope_theta"] == neox_theta, ncfg.rope_parameters
    nrope = modeling_gpt_neox.GPTNeoXRotaryEmbedding(ncfg)
    cos_partial, sin_partial = nrope(q, position_ids)
    partial_dim = cos_partial.shape[-1]
    assert partial_dim == int(D * neox_pct) == 8, cos_partial.shape
    q_partial, k_partial = modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos_partial, sin_partial)
    assert torch.equal(q_partial[..., partial_dim:], q[..., partial_dim:])

    # Interleaved (GPT-J rotate_every_two), rotary_dim 8 of 16. GPT-J works on (B, T, H, D)
    # and its theta is fixed at 10000 in create_sinusoidal_positions.
    gptj_dim, gptj_theta = 8, 10000.0
    jcfg = GPTJConfig(n_embd=H * D * 2, n_head=2 * H, rotary_dim=gptj_dim, n_positions=128)
    jrope = modeling_gptj.GPTJRotaryEmbedding(jcfg)
    table = modeling_gptj.create_sinusoidal_positions(128, gptj_dim)
    assert torch.equal(jrope.embed_positions, table)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    sin_j, cos_j = jrope(qt, position_ids)
    assert sin_j.shape == (1, T, gptj_dim // 2), sin_j.shape

    def gptj(x):  # GPTJAttention.forward's rotary_dim branch
        rot = modeling_gptj.apply_rotary_pos_emb(x[..., :gptj_dim], sin_j, cos_j)
        return torch.cat([rot, x[..., gptj_dim:]], dim=-1).transpose(1, 2)

    q_inter, k_inter = gptj(qt), gptj(kt)

    tensors = {
        "q": q, "k": k, "positions": positions,
        "cos_half": cos_half, "sin_half": sin_half, "q_half": q_half, "k_half": k_half,
        "cos_partial": cos_partial, "sin_partial": sin_partial, "q_partial": q_partial, "k_partial": k_partial,
        "sin_interleaved": sin_j, "cos_interleaved": cos_j,
        "q_interleaved": q_inter, "k_interleaved": k_inter,
    }
    case = {
        "layout": "q, k and every q_*/k_* are (batch 1, heads %d, T %d, head_dim %d); positions = %d..%d "
                  "(as if a cache held %d tokens)" % (H, T, D, OFFSET, OFFSET + T - 1, OFFSET),
        "head_dim": D, "offset": OFFSET, "T": T,
        "half": {
            "form": "half-split (rotate_half) over the whole head", "rotary_dim": D, "theta": llama_theta,
            "cos_sin": "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(LlamaConfig(rope_theta=%s))"
                       "(q, positions[None]) -> cos_half, sin_half (1, T, %d)" % (llama_theta, D),
            "apply": "transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)",
        },
        "partial": {
            "form": "half-split (rotate_half) over the first rotary_dim dims, the rest passed through",
            "rotary_dim": partial_dim, "rotary_pct": neox_pct, "theta": neox_theta,
            "inv_freq": "1 / theta^(arange(0, rotary_dim, 2) / rotary_dim) (exponent over rotary_dim, not head_dim)",
            "cos_sin": "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXRotaryEmbedding("
                       "GPTNeoXConfig(rotary_pct=0.5, rotary_emb_base=10000))(q, positions[None]) "
                       "-> cos_partial, sin_partial (1, T, %d)" % partial_dim,
            "apply": "transformers.models.gpt_neox.modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)",
        },
        "interleaved": {
            "form": "interleaved pairs (rotate_every_two) over the first rotary_dim dims, the rest passed through",
            "rotary_dim": gptj_dim, "theta": gptj_theta,
            "sin_cos": "transformers.models.gptj.modeling_gptj.GPTJRotaryEmbedding(GPTJConfig(rotary_dim=8))"
                       "(x, positions[None]) -> sin_interleaved, cos_interleaved (1, T, %d); its table is "
                       "create_sinusoidal_positions(128, 8) (theta hard-coded 10000)" % (gptj_dim // 2),
            "apply": "transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb(x[..., :8], sin, cos) on "
                     "x = q.transpose(1, 2) (GPT-J's (B, T, H, D)), then cat with x[..., 8:] as "
                     "GPTJAttention.forward does, transposed back to (B, H, T, D)",
        },
        **VERSIONS,
    }
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(tmp, "rotary.safetensors"), metadata={"case": json.dumps(case)})
    return case


README = """\
# Decoder fixtures (GPT-2, Llama, rotary)

Made by `scripts/make_decoder_fixtures.py` (random init, offline, float32) with
torch {torch} and transformers {transformers}. Remake with

    .venv-ref/bin/python scripts/make_decoder_fixtures.py

(it writes a temporary folder and replaces this one only if every check passed;
`--only NAME ...` rebuilds those models alone, in place, keeping the rest and
`half_expected.safetensors`, which `scripts/make_half_fixtures.py` writes).

* `gpt2/`: `GPT2LMHeadModel` (n_embd 64, n_layer 2, n_head 4, vocab 128,
  n_positions 64, gelu_new), as `save_pretrained(safe_serialization=True)`
  wrote it (also `generation_config.json`). lm_head is tied to `transformer.wte.weight` (no `lm_head.weight`
  in the file); attention / MLP projections are HF `Conv1D`, weight (in, out).
* `llama/`: `LlamaForCausalLM` (hidden 64, intermediate 128, 2 layers,
  4 heads, 2 KV heads, vocab 128, rope_theta 50000, rms_norm_eps 1e-6,
  untied lm_head, no attention bias), saved the same way. Note that
  transformers 5 writes rope_theta inside `rope_parameters` in config.json.
* `mistral/`: `MistralForCausalLM` (as llama/, but 1 KV head (multi-query),
  sliding_window 4, rope_theta 10000, tied lm_head), saved the same way.
* `llama3/`: as llama/, with Llama 3.1's rope scaling (`rope_type`
  llama3, factor 8, low/high freq factors 1/4, original context 32, so
  the head's frequencies fall in all three bands), rope_theta 10000.
* `qwen2/`: `Qwen2ForCausalLM` (biases on q/k/v only, rope_theta 1e6,
  tied lm_head, `sliding_window` 4 switched off by `use_sliding_window`
  false).
* `qwen3/`: `Qwen3ForCausalLM` (RMSNorm `q_norm`/`k_norm` per head,
  head_dim 32 with hidden 64 and 4 heads, so q is 128 wide; tied lm_head).
* `smollm3/`: `SmolLM3ForCausalLM` (`no_rope_layers` [0, 1]: layer 0
  has no rotary; rope_theta 2e6, tied lm_head).
* `olmo2/`: `Olmo2ForCausalLM` (RMSNorms after attention and MLP, none
  before; `q_norm`/`k_norm` over all heads at once, 64 and 32 wide;
  rope_theta 5e5, untied lm_head).
* `phi3/`: `Phi3ForCausalLM` (fused `qkv_proj` and `gate_up_proj`;
  partial_rotary_factor 0.75, so 12 of each 16-wide head rotate; rotary
  `longrope` with short and long factors, original context 2 of 4, so
  the attention factor is sqrt(2) and every prompt here runs on
  long_factor; sliding_window 5; untied lm_head). Its expected file also
  has `short_logits` (2, 2, 128): the first 2 prompt tokens alone, on
  short_factor.
* `gemma2/`: `Gemma2ForCausalLM` (sandwich norms, `(1 + w)` RMSNorms,
  embeddings times sqrt(64), GeGLU, head_dim 32, query_pre_attn_scalar 24,
  scores soft-capped at 4 and logits at 6, layer 0 sliding (window 4),
  layer 1 full; tied lm_head).
* `gemma3/`: `Gemma3ForCausalLM` (`gemma3_text`: Gemma 2's blocks with
  `(1 + w)` RMSNorms on each head of q and k, no soft-capping; layer 0
  sliding (window 4, rope_theta 1e4), layer 1 full (rope_theta 1e6,
  linear scaling factor 8)).
* `gemma3_mm/`: `Gemma3ForConditionalGeneration` (`gemma3`: the text
  model under `language_model.`, here `gemma3/`'s weights, beside a
  one-layer SigLIP vision tower and its projector); its text-only logits
  equal `gemma3/`'s (checked by the script), so its tests reuse
  `gemma3_expected.safetensors`.
* `{{gpt2,llama,mistral,llama3,qwen2,qwen3,smollm3,olmo2,phi3,gemma2,gemma3}}_expected.safetensors`: `input_ids`
  (2, 7), `logits` (2, 7, 128) of the full prompt, `greedy_ids` (2, 17) and
  `step_logits` (2, 10, 128) from greedy `generate` (10 new tokens, no EOS),
  and a left-padded batch: `padded_ids`, `padded_attention_mask`,
  `padded_position_ids` (2, 7; row 1 has 3 pads of id 0 then 4 tokens),
  `padded_greedy_ids` (2, 17), `padded_step_logits` (2, 10, 128). Metadata
  "case" (JSON) has the seed, generate's arguments, the greedy margins
  (top-1 minus runner-up, at least 1e-2 at every step) and whether the padded
  row's generation equals the short prompt's generated alone. generate gives
  the model `padded_position_ids` = cumsum(mask)-1 (0 on pads), then +1 per
  step: GPT-2 must use them (absolute wpe); Llama's RoPE is shift-invariant.
* `rotary.safetensors`: HF's rotary on random `q`, `k` (1, 2, 6, 16) at
  `positions` 5..10: `q_half`/`k_half` (Llama `apply_rotary_pos_emb`, theta
  500000), `q_partial`/`k_partial` (GPT-NeoX, rotary_pct 0.5 so rotary_dim 8,
  theta 10000), `q_interleaved`/`k_interleaved` (GPT-J `rotate_every_two`,
  rotary_dim 8, theta 10000), with the cos/sin each used. Metadata "case"
  names the function that produced each.
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT, help="output folder (replaced as a whole)")
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), metavar="NAME",
                        help="rebuild these models alone, replacing their folders and expected files in --out "
                             "(and its README) and keeping everything else")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    names = args.only or list(MODELS)

    tmp = tempfile.mkdtemp(prefix=".decoders-", dir=parent)
    try:
        cases = {}
        for name in names:
            cases[name], files = build_decoder(name, tmp)
            print(f"{name}/: {', '.join(files)}")
            size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(os.path.join(tmp, name))
                       for n in ns)
            assert size < 1_000_000, f"{name}/ is too large: {size} B"
            if name == "gemma3":
                print(f"gemma3_mm/: {', '.join(gemma3_multimodal(tmp))}")
        rot = None if args.only else rotary(tmp)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(README.format(**VERSIONS))

        total = 0
        for root, _, files in os.walk(tmp):
            for n in sorted(files):
                size = os.path.getsize(os.path.join(root, n))
                total += size
                print(f"  {os.path.relpath(os.path.join(root, n), tmp):40s} {size:9d} B")
        print(f"  total {total} B")
        assert total < 4_000_000, f"fixtures too large: {total} B"
        for name, case in cases.items():
            print(f"{name}: seed {case['seed']}, greedy min margins {case['greedy_min_margin']}, "
                  f"padded {case['padded']['row1_equals_unpadded_tokens']} "
                  f"(max abs step-logit diff {case['padded']['row1_max_abs_step_logit_diff_vs_unpadded']:.3g})")
        if rot:
            print(f"rotary: half theta {rot['half']['theta']}, partial rotary_dim {rot['partial']['rotary_dim']}, "
                  f"interleaved rotary_dim {rot['interleaved']['rotary_dim']}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    if args.only:
        # Each model's folder and expected file replace their old selves.
        os.makedirs(out, exist_ok=True)
        for entry in os.listdir(tmp):
            src, dst = os.path.join(tmp, entry), os.path.join(out, entry)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            os.replace(src, dst)
        os.rmdir(tmp)
        print(f"wrote {', '.join(names)} into {out}")
        return

    os.chmod(tmp, 0o755)
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=".decoders-old-", dir=parent)
        os.rmdir(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old:
        shutil.rmtree(old)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
