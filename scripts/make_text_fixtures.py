#!/usr/bin/env python3
"""Write the text-in, text-out fixtures: decoder folders with a tokenizer, a
generation config and HF's own generated text.

Everything lands in tests/fixtures/text/:

* `gpt2-bpe/`: a byte-level BPE tokenizer trained here with the `tokenizers`
  library on generated text with accents, CJK and emoji (so that tokens
  split multi-byte characters), wrapped as a transformers fast tokenizer,
  and a tiny random-init `GPT2LMHeadModel` over its vocabulary;
  `generation_config.json` names `<|endoftext|>` as the end token.
* `llama3/`: the same kind of tokenizer with Llama 3's special tokens
  (`<|begin_of_text|>` added before every prompt by the post-processor,
  `<|end_of_text|>`, `<|eot_id|>`, header tokens) and a tiny
  `LlamaForCausalLM`; `generation_config.json` lists two end tokens, and
  `<|eot_id|>`'s output row is scaled up so that some prompts end on it.
* `llama2-sp/`: a SentencePiece-style tokenizer as Llama 2's
  `tokenizer.json` is built: BPE over text whose spaces are `▁` (prepended
  and replaced by the normalizer), the 256 `<0xXX>` byte tokens after
  `<unk>`, `<s>`, `</s>` and byte fallback for every character the merges
  lack (accents, CJK, emoji), `<s>` added before every prompt; a tiny
  `LlamaForCausalLM`; `</s>` ends generation. No chat template.
* `expected.json`: per folder and prompt, what HF does: the prompt's ids
  (`tokenizer(prompt)`), greedy `generate` with the folder's
  generation config (`new_ids`, whether it ended on an end token) and
  `tokenizer.decode(new_ids, skip_special_tokens=True)` (`text`).

Weights use a large init so that greedy decoding is decided by a margin of at
least MIN_MARGIN at every step (else the next seed is tried). Written into a
temporary folder that replaces tests/fixtures/text only when all of it
succeeded. Offline, a few seconds:

    .venv-ref/bin/python scripts/make_text_fixtures.py
"""

import json
import os
import random
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # noqa: E402
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "text")
MAX_NEW = 16
MIN_MARGIN = 1e-3
VOCAB = 384

PROMPTS = [
    "Hello world",
    "The cat sat on the mat.",
    "héllo wörld, ça va?",
    "日本語のテキスト",
    "emoji 🙂 and more",
    "a",
]

# Llama 3 Instruct's chat template, as its tokenizer_config.json has it.
LLAMA3_CHAT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# A ChatML-style template that uses what HF's renderer adds to Jinja: a
# Python string method, `raise_exception`, and blocks whose whitespace
# `trim_blocks` / `lstrip_blocks` remove.
CHATML = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'].strip() + '<|im_end|>\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}
{% endif %}"""

CONVERSATIONS = [
    ([{"role": "user", "content": "Hello world"}], True),
    ([{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "héllo"},
      {"role": "assistant", "content": "ça va"}, {"role": "user", "content": " 日本語 "}], True),
    ([{"role": "user", "content": "Hello world"}], False),
]

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def corpus():
    """Deterministic training text: words, accents, CJK, emoji."""
    rng = random.Random(7)
    words = ("the cat sat on mat hello world text more and a dog runs fast over lazy "
             "héllo wörld ça va très bien naïve café 日本語 の テキスト 中文 字 🙂 🎉 emoji").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]


def byte_level_bpe(special):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def gpt2_tokenizer():
    tok = byte_level_bpe(["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML
    return tok


def llama3_tokenizer():
    tok = byte_level_bpe(LLAMA3_SPECIAL)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = LLAMA3_CHAT
    return tok


def sentencepiece_tokenizer():
    """Llama 2's layout: '▁' for spaces, byte fallback through <0xXX> tokens."""
    spaces = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    # Merges learnt on ASCII text only: every other character falls back
    # to its UTF-8 bytes.
    rng = random.Random(7)
    words = "the cat sat on mat hello world text more and a dog runs fast over lazy".split()
    ascii_corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    learn = Tokenizer(models.BPE(unk_token="<unk>"))
    learn.normalizer = spaces
    learn.train_from_iterator(ascii_corpus, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    learnt = json.loads(learn.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for token, _ in sorted(learnt["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = spaces
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def llama2_model(tok, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    randomize_norms_and_biases(model)
    with torch.no_grad():
        model.lm_head.weight[2] *= 2.0
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=MAX_NEW,
                                               do_sample=False)
    return model.float().eval()


def randomize_norms_and_biases(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "ln" in name or "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


def gpt2_model(tok, seed):
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=eos, eos_token_id=eos, attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg)
    randomize_norms_and_biases(model)
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, max_new_tokens=MAX_NEW, do_sample=False,
    )
    return model.float().eval()


def llama3_model(tok, seed):
    torch.manual_seed(seed)
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA3_SPECIAL}
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    randomize_norms_and_biases(model)
    with torch.no_grad():
        # Make the end tokens likely enough that some prompts end on them.
        model.lm_head.weight[ids["<|eot_id|>"]] *= 2.0
        model.lm_head.weight[ids["<|end_of_text|>"]] *= 1.8
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        max_new_tokens=MAX_NEW, do_sample=False,
    )
    return model.float().eval()


def chat_ids(tok, conversation, add_generation_prompt):
    """apply_chat_template's text and ids (tokenized without added special tokens)."""
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids == tok(text, add_special_tokens=False).input_ids, "chat ids are not the text's"
    return text, ids


def run(model, tok):
    """HF's answers for every prompt (and the first conversation as a chat
    prompt), and the smallest greedy margin."""
    rows, least = [], float("inf")
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    chat_prompt = chat_ids(tok, *CONVERSATIONS[0])[1] if tok.chat_template else None
    for prompt in PROMPTS + ([None] if chat_prompt else []):
        if prompt is None:
            ids = torch.tensor([chat_prompt])
        else:
            ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=model.generation_config,
            output_logits=True, return_dict_in_generate=True, pad_token_id=eos[0],
        )
        new = out.sequences[0, ids.shape[1]:].tolist()
        logits = torch.stack(out.logits, 1)[0].float()
        top2 = logits.topk(2, -1).values
        least = min(least, float((top2[:, 0] - top2[:, 1]).min()))
        ended = bool(new) and new[-1] in eos
        rows.append({
            "prompt": prompt if prompt is not None else CONVERSATIONS[0][0][0]["content"],
            "chat": prompt is None,
            "prompt_ids": ids[0].tolist(),
            "new_ids": new,
            "ended_on": new[-1] if ended else None,
            "text": tok.decode(new, skip_special_tokens=True),
        })
    return rows, least


def build(name, make_tok, make_model, out_dir):
    tok = make_tok()
    for seed in range(200):
        model = make_model(tok, seed)
        rows, least = run(model, tok)
        if least < MIN_MARGIN:
            continue
        if name == "llama3" and not {r["ended_on"] for r in rows} >= {None, *model.generation_config.eos_token_id}:
            # Both end tokens must end some prompt, and some prompt must run
            # to the length limit.
            continue
        if not any("\ufffd" in r["text"] for r in rows):
            # Some continuation must split a multi-byte character.
            continue
        break
    else:
        raise SystemExit(f"{name}: no seed gives margins >= {MIN_MARGIN} and the cases wanted")
    folder = os.path.join(out_dir, name)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    # Reloaded as a user would, the folder must give the same answers.
    again = (GPT2LMHeadModel if name.startswith("gpt2") else LlamaForCausalLM).from_pretrained(folder).eval()
    tok2 = PreTrainedTokenizerFast.from_pretrained(folder)
    rows2, _ = run(again, tok2)
    assert rows2 == rows, f"{name}: reloaded folder differs"
    print(f"{name}: seed {seed}, least margin {least:.4f}, vocab {len(tok)}")
    chats = []
    for conversation, add_generation_prompt in CONVERSATIONS if tok2.chat_template else []:
        text, ids = chat_ids(tok2, conversation, add_generation_prompt)
        chats.append({"messages": conversation, "add_generation_prompt": add_generation_prompt,
                      "text": text, "ids": ids})
    return {"seed": seed, "least_margin": least, "cases": rows, "chats": chats,
            "stop": stop_case(again, tok2, rows)}


def stop_case(model, tok, rows):
    """Greedy generation of the first prompt with `stop_strings`: a
    two-character piece of its text (no U+FFFD), from its second half."""
    row = next(r for r in rows if not r.get("chat") and len(r["text"]) >= 6)
    text = row["text"]
    start = next(i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    ids = torch.tensor([row["prompt_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=model.generation_config,
                         stop_strings=[stop], tokenizer=tok)
    new = out[0, ids.shape[1]:].tolist()
    return {"prompt": row["prompt"], "stop": stop, "new_ids": new,
            "text": tok.decode(new, skip_special_tokens=True)}


def main():
    parent = os.path.dirname(os.path.abspath(OUT))
    tmp = tempfile.mkdtemp(prefix="text-", dir=parent)
    try:
        expected = {
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
            "max_new_tokens": MAX_NEW,
            "gpt2-bpe": build("gpt2-bpe", gpt2_tokenizer, gpt2_model, tmp),
            "llama3": build("llama3", llama3_tokenizer, llama3_model, tmp),
            "llama2-sp": build("llama2-sp", sentencepiece_tokenizer, llama2_model, tmp),
        }
        with open(os.path.join(tmp, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(expected, f, ensure_ascii=False, indent=1)
            f.write("\n")
        # The folder's README is written by hand: kept.
        readme = os.path.join(OUT, "README.md")
        if os.path.exists(readme):
            shutil.copy(readme, os.path.join(tmp, "README.md"))
        if os.path.exists(OUT):
            shutil.rmtree(OUT)
        os.rename(tmp, OUT)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
