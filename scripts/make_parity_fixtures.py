#!/usr/bin/env python3
"""Write tests/fixtures/text/parity.json: what HF transformers and its Jinja2
chat-template environment answer where this crate once answered otherwise
(issue "HF's answers on every folder, round three"). Reads the committed
text fixtures (tests/fixtures/text/*), writes one JSON file:

* `repetition_penalty`: greedy `generate` of each folder's prompts with
  `repetition_penalty` 1.3 (HF divides positive logits, multiplies negative
  ones, over the prompt's and the generated ids): `new_ids`.
* `truncation_padding`: `tokenizer(prompt)` with a `tokenizer.json` whose
  `truncation` (max_length 3) and `padding` are set: HF switches both off.
* `templates`: small templates rendered by HF's own environment
  (`_compile_jinja_template`): `tojson` with insertion order, `indent`,
  `sort_keys`, `separators`, `ensure_ascii`; Python float repr; Jinja's
  forgiving `int` and `float`; `{% generation %}`; the `iterable` test
  (`none` is not iterable in Python).
* `special_tokens_map`: `apply_chat_template` on a folder whose
  `bos_token` is only in `special_tokens_map.json`.
* `conversation`: greedy replies of the llama3 folder, turn after turn,
  each to the conversation so far (HF's own replies appended).
* `chat_templates`: real models' chat templates (`tests/fixtures/chat_templates`,
  copies of llama.cpp's `models/templates`: Gemma 2, Phi-3.5, SmolLM3)
  rendered by HF's own path (`render_jinja_template`, what
  `apply_chat_template` calls) over a few conversations, with and without
  the generation prompt, the model's special tokens as its tokenizer passes
  them, and extra arguments (SmolLM3's `enable_thinking`); `text`, or
  `error`, the message of the exception the template raises.

Offline, a few seconds:

    .venv-ref/bin/python scripts/make_parity_fixtures.py
"""

import json
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "tests", "fixtures", "text")
# Outside TEXT, which make_text_fixtures.py replaces whole.
CHAT_TEMPLATES_DIR = os.path.join(HERE, "..", "tests", "fixtures", "chat_templates")
PENALTY = 1.3
# The conversation's replies: the random model often ends a turn at once.
MIN_NEW_TOKENS = 4

TEMPLATES = [
    "{{ {'b': 1, 'a': [1, 2.5, none, true], 'c': {}}|tojson }}",
    "{{ {'b': 1, 'a': [1, {'z': 'é'}]}|tojson(indent=2) }}",
    "{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
    "{{ {'b': 1, 'a': [1, 2]}|tojson(separators=(',', ':')) }}",
    "{{ ['é', '日本', '😀', 'a\"b\\\\c\\n\\t\\x01']|tojson(ensure_ascii=true) }}",
    "{{ messages|tojson }}",
    "{{ 3e-07 }} {{ 1e16 }} {{ 0.0001 }} {{ 100.0 }} {{ 1.5 }} {{ [3e-07]|tojson }}",
    "{{ 'x'|int }} {{ '42'|int }} {{ ' 7 '|int }} {{ '3.9'|int }} {{ 'x'|int(5) }} {{ 2.7|int }} {{ none|int }}",
    "{{ 'x'|float }} {{ '2.5'|float }} {{ 3|float }}",
    "{% for m in messages %}{{ m.role }}:{%- generation -%} {{ m.content }} {%- endgeneration %};{% endfor %}",
    "{{ none is iterable }} {{ nothing is iterable }} {{ [] is iterable }} {{ 'ab' is iterable }} "
    "{{ {} is iterable }} {{ 1 is iterable }} {{ messages is iterable }}"
    "{% if none is iterable and none | length > 0 %}x{% endif %}",
]
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


# template file: the special tokens its model's tokenizer passes.
CHAT_TEMPLATES = {
    "google-gemma-2-2b-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                   "pad_token": "<pad>"},
    "microsoft-Phi-3.5-mini-instruct.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                                              "unk_token": "<unk>", "pad_token": "<|endoftext|>"},
    "HuggingFaceTB-SmolLM3-3B.jinja": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
}

SYSTEM = {"role": "system", "content": "  Be brief. "}
# (messages, add_generation_prompt, extra arguments)
CHAT_CASES = [
    ([SYSTEM, {"role": "user", "content": "Hello world"}], True, {}),
    ([{"role": "user", "content": " héllo\n"}], True, {}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nça va "},
      {"role": "user", "content": "日本語?"}], True, {}),
    ([SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"},
      {"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}], False, {}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"}], False, {}),
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}], True, {}),
    ([{"role": "system", "content": "Think hard. /no_think  "}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "yo"}], True, {}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"}], True,
     {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Calling."},
      {"role": "tool", "content": "{\"temp\": 21}"}], True, {"enable_thinking": True}),
]


def chat_templates():
    out = []
    for name, special in CHAT_TEMPLATES.items():
        with open(os.path.join(CHAT_TEMPLATES_DIR, name), encoding="utf-8") as f:
            source = f.read()
        cases = []
        for messages, add_generation_prompt, args in CHAT_CASES:
            case = {"messages": messages, "add_generation_prompt": add_generation_prompt, "args": args}
            try:
                rendered, _ = render_jinja_template(conversations=[messages], chat_template=source,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **special, **args)
                case["text"] = rendered[0]
            except Exception as e:  # noqa: BLE001 - the template's own error is the answer
                case["error"] = str(e)
            cases.append(case)
        out.append({"template": name, "special_tokens": special, "cases": cases})
    return out


def repetition_penalty(expected):
    out = {}
    for name in ("llama3", "llama2-sp", "gpt2-bpe"):
        folder = os.path.join(TEXT, name)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rows = []
        for case in expected[name]:
            prompt = case["prompt"]
            ids = torch.tensor([tok(prompt)["input_ids"]])
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=16, repetition_penalty=PENALTY,
                                     generation_config=model.generation_config)
            rows.append({"prompt": prompt, "new_ids": gen[0, ids.shape[1]:].tolist()})
        out[name] = rows
    return {"penalty": PENALTY, "folders": out}


def truncation_padding():
    src = os.path.join(TEXT, "llama3", "tokenizer.json")
    with open(src, encoding="utf-8") as f:
        spec = json.load(f)
    spec["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 1, "pad_type_id": 0, "pad_token": "<|end_of_text|>"}
    with tempfile.TemporaryDirectory() as d:
        for f in ("tokenizer_config.json",):
            shutil.copy(os.path.join(TEXT, "llama3", f), d)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f, ensure_ascii=False)
        tok = AutoTokenizer.from_pretrained(d)
        prompt = "The quick brown fox jumps over the lazy dog"
        return {"tokenizer_json": spec, "prompt": prompt, "ids": tok(prompt)["input_ids"]}


def templates():
    return [{"template": t, "text": _compile_jinja_template(t).render(messages=MESSAGES)} for t in TEMPLATES]


def special_tokens_map():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    with tempfile.TemporaryDirectory() as d:
        for f in ("tokenizer.json", "config.json"):
            shutil.copy(os.path.join(TEXT, "llama2-sp", f), d)
        with open(os.path.join(TEXT, "llama2-sp", "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        for key in ("bos_token", "eos_token", "unk_token"):
            config.pop(key, None)
        config["chat_template"] = template
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        stm = {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False}, "eos_token": "</s>"}
        with open(os.path.join(d, "special_tokens_map.json"), "w", encoding="utf-8") as f:
            json.dump(stm, f)
        tok = AutoTokenizer.from_pretrained(d)
        text = tok.apply_chat_template(MESSAGES, tokenize=False)
        return {"tokenizer_config": config, "special_tokens_map": stm, "text": text}


def conversation():
    """HF's greedy replies, turn after turn, each to the conversation so far
    (`apply_chat_template(history, add_generation_prompt=True)`, the reply
    decoded with `skip_special_tokens=True` and appended as the assistant's)."""
    folder = os.path.join(TEXT, "llama3")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    history = [{"role": "system", "content": "Be brief."}]
    turns = []
    for user in ["Hello world", "héllo again, 日本語?", "and once more"]:
        history.append({"role": "user", "content": user})
        ids = torch.tensor([tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 min_new_tokens=MIN_NEW_TOKENS, generation_config=model.generation_config)
        new_ids = gen[0, ids.shape[1]:].tolist()
        text = tok.decode(new_ids, skip_special_tokens=True)
        turns.append({"user": user, "new_ids": new_ids, "text": text})
        history.append({"role": "assistant", "content": text})
    return {"system": "Be brief.", "min_new_tokens": MIN_NEW_TOKENS, "turns": turns}


def main():
    with open(os.path.join(TEXT, "expected.json"), encoding="utf-8") as f:
        expected = json.load(f)
    prompts = {name: [c for c in expected[name]["cases"] if not c["chat"]]
               for name in ("llama3", "llama2-sp", "gpt2-bpe")}
    out = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "repetition_penalty": repetition_penalty(prompts),
        "truncation_padding": truncation_padding(),
        "templates": templates(),
        "special_tokens_map": special_tokens_map(),
        "conversation": conversation(),
        "chat_templates": chat_templates(),
    }
    with open(os.path.join(TEXT, "parity.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
