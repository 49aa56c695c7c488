#!/usr/bin/env python3
"""Train the character-level date normaliser that `multihead seq2seq` ships.

Dates written the ways people write them are translated to ISO
"2021-03-03" by a small `nn.Transformer` with character embeddings,
sinusoidal positions and an output projection (`DateTranslator` below; the
Rust side is `multihead_models::transformer::Seq2Seq`).

The generator draws a format family uniformly, then a format in it
(`families` below); held-out exact match is reported per family:
- english: "March 3, 2021", "3rd of March 2021", "03-Mar-2021", ...;
- ordinal_words: "the twenty-first of May 2021", "May the third, 2021";
- weekday: weekday prefixes in English, German, French and Spanish;
- german / french / spanish: "3. März 2021", "le 1er mars 2021",
  "3 de marzo de 2021";
- numeric / numeric_yy: day-first and month-first with "/", "." or "-",
  padded or not, four- or two-digit years;
- year_first: "2021-03-03", "2021/3/3", "2021.03.03", "2021 03 03",
  "20210303", "2021年3月3日".

Conventions the data fixes, so that every input has one answer:
- years are 1950..=2049; a two-digit year `yy` is 20yy when yy < 50, else 19yy;
- the source starts with a reading token, `<mdy>` or `<dmy>`: an all-numeric
  date whose day is 12 or less ("03/04/2021") is read month first or day
  first as it says (`multihead seq2seq --day-first`; month first by default,
  as dateutil). One with a part above 12 is unambiguous and written either
  way round under either token;
- a leading four-digit year is year-month-day.

The held-out split is by date: no held-out date appears in training, in any
format. The previous model's held-out examples (the same split; each read
under the convention that model had: dots and dashes day first, slashes
month first) are kept as family "legacy": a new model that gets fewer of
them right than the previous one is not written over it.

Writes, in weights/dates/ (about 1.1 MB in all), through a temporary folder
that replaces the files only when everything is written:
- model.safetensors: the state_dict, PyTorch's names, f32;
- config.json: the architecture and the special tokens (Seq2SeqConfig);
- vocab.json: source and target characters, by id;
- heldout.json: the held-out inputs with their family and reading token,
  their ISO answers and PyTorch's greedy outputs (what
  crates/models/tests/seq2seq_dates.rs compares against).

Regenerate (torch, safetensors; one thread, about 0.27 s a step on an idle
core). From scratch, ~11 minutes for 2,500 steps; fine-tuning the shipped
model onto the wider generator:

    .venv-ref/bin/python scripts/train_dates.py --init weights/dates --steps 3000 --lr 1e-3
"""

import argparse
import datetime as dt
import json
import math
import os
import random
import re
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "weights", "dates")

FIRST = dt.date(1950, 1, 1)
LAST = dt.date(2049, 12, 31)
MONTHS = ["January", "February", "March", "April", "May", "June", "July",
          "August", "September", "October", "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
# Month and weekday names by language (weekdays Monday first, as
# `date.weekday()` counts).
LANGS = {
    "de": (["Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August",
            "September", "Oktober", "November", "Dezember"],
           ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag", "Sonntag"]),
    "fr": (["janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août",
            "septembre", "octobre", "novembre", "décembre"],
           ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"]),
    "es": (["enero", "febrero", "marzo", "abril", "mayo", "junio", "julio", "agosto",
            "septiembre", "octubre", "noviembre", "diciembre"],
           ["lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo"]),
}
ORDINAL_WORDS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh",
                 "eighth", "ninth", "tenth", "eleventh", "twelfth", "thirteenth",
                 "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
                 "nineteenth"]

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<bos>", "<eos>"]
# The source starts with one of these: how to read an ambiguous all-numeric
# date (both leading parts <= 12). Month first is dateutil's default
# (`dayfirst=False`); `multihead seq2seq --day-first` picks the other.
MONTH_FIRST, DAY_FIRST = "<mdy>", "<dmy>"
TGT_CHARS = list("0123456789-")


def ordinal(n):
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def ordinal_word(n):
    """1 -> "first", 21 -> "twenty-first", 30 -> "thirtieth"."""
    if n < 20:
        return ORDINAL_WORDS[n]
    tens, ones = divmod(n, 10)
    name = {2: "twent", 3: "thirt"}[tens]
    return f"{name}ieth" if ones == 0 else f"{name}y-{ORDINAL_WORDS[ones]}"


def month_abbr(m):
    # "Sept" is how many people abbreviate September; the rest are 3 letters.
    return "Sept" if m == 9 and random.random() < 0.3 else MONTHS[m - 1][:3]


def numeric(d, day_first, sep, pad, two_digit_year):
    """"21/05/2021", "5.21.21", ...: day and month in the order asked."""
    a, b = (d.day, d.month) if day_first else (d.month, d.day)
    y = f"{d.year % 100:02d}" if two_digit_year else f"{d.year}"
    if pad:
        return f"{a:02d}{sep}{b:02d}{sep}{y}"
    return f"{a}{sep}{b}{sep}{y}"


def families(d, day_first):
    """Every way this script writes the date `d`, by format family: a dict
    family -> list of texts. `day_first` is the reading of an ambiguous
    numeric date: such a date is written in that order; an unambiguous one
    (a part above 12) in either order."""
    y, m, day = d.year, d.month, d.day
    mon, mo3, wd, wd3 = MONTHS[m - 1], month_abbr(m), DAYS[d.weekday()], DAYS[d.weekday()][:3]
    yy = y % 100
    # An ambiguous date must be written in the order the prefix announces.
    order = day_first if (day <= 12 and m <= 12) and day != m else random.random() < 0.5
    sep = random.choice("/.-")
    pad = random.random() < 0.5
    de_m, de_w = LANGS["de"][0][m - 1], LANGS["de"][1][d.weekday()]
    fr_m, fr_w = LANGS["fr"][0][m - 1], LANGS["fr"][1][d.weekday()]
    es_m, es_w = LANGS["es"][0][m - 1], LANGS["es"][1][d.weekday()]
    fr_day = "1er" if day == 1 else str(day)
    ow = ordinal_word(day)
    return {
        "english": [
            f"{mon} {day}, {y}",
            f"{mon} {day} {y}",
            f"{day} {mon} {y}",
            f"{day} {mon}, {y}",
            f"{ordinal(day)} of {mon} {y}",
            f"the {ordinal(day)} of {mon}, {y}",
            f"{mon} {ordinal(day)}, {y}",
            f"{day} {mo3} {y}",
            f"{mo3} {day}, {y}",
            f"{day:02d}-{mo3}-{y}",
            f"{mon.upper()} {day}, {y}",
            f"{day} {mon.lower()} {y}",
        ],
        "ordinal_words": [
            f"the {ow} of {mon} {y}",
            f"the {ow} of {mon}, {y}",
            f"{mon} the {ow}, {y}",
            f"{ow} of {mon} {y}",
            f"{mon} {ow} {y}",
        ],
        "weekday": [
            f"{wd}, {mon} {day}, {y}",
            f"{wd} {day} {mon} {y}",
            f"{wd3} {day} {mo3} {y}",
            f"{wd}, the {ordinal(day)} of {mon} {y}",
            f"{wd3}, {numeric(d, order, '/', pad, False)}",
            f"{de_w}, {day}. {de_m} {y}",
            f"{fr_w} {fr_day} {fr_m} {y}",
            f"{es_w}, {day} de {es_m} de {y}",
        ],
        "german": [f"{day}. {de_m} {y}", f"{day} {de_m} {y}", f"{day:02d}. {de_m} {y}"],
        "french": [f"{fr_day} {fr_m} {y}", f"le {fr_day} {fr_m} {y}", f"{fr_day} {fr_m.upper()} {y}"],
        "spanish": [f"{day} de {es_m} de {y}", f"{day} {es_m} {y}", f"{day} de {es_m}, {y}"],
        "numeric": [numeric(d, order, sep, pad, False)],
        "numeric_yy": [numeric(d, order, sep, pad, True)],
        "year_first": [
            f"{y}-{m:02d}-{day:02d}",
            f"{y}/{m:02d}/{day:02d}",
            f"{y}.{m:02d}.{day:02d}",
            f"{y} {m:02d} {day:02d}",
            f"{y}/{m}/{day}",
            f"{y}.{m}.{day}",
            f"{y}{m:02d}{day:02d}",
            f"{y}年{m}月{day}日",
            f"{y}年{m:02d}月{day:02d}日",
        ],
    }


FAMILIES = list(families(dt.date(2021, 3, 3), False))


def render(d, family=None):
    """(family, prefix, text): one random way of writing `d`, with the
    day-first/month-first prefix it is read under."""
    day_first = random.random() < 0.5
    fams = families(d, day_first)
    family = family or random.choice(FAMILIES)
    return family, DAY_FIRST if day_first else MONTH_FIRST, random.choice(fams[family])


def iso(d):
    return d.isoformat()


def legacy_day_first(text):
    """The reading the previous model (one convention per separator) gave
    an all-numeric date: dots and dashes day first, slashes month first."""
    return bool(re.fullmatch(r"\d{1,2}[.-]\d{1,2}[.-]\d{2,4}", text))


def source_chars():
    chars = set()
    for m in range(1, 13):
        for day in range(1, 32, 3):
            for y in (1999, 2021):
                d = dt.date(y, m, min(day, 28))
                for texts in families(d, False).values():
                    for s in texts:
                        chars.update(s)
    chars.update("0123456789")
    chars.update("Sept")
    # Characters the previous model read, so that its rows carry over.
    chars.update(" ,-./ACDEFJMNOSTWadehilnoprtuvy年日月")
    return sorted(chars)


class PositionalEncoding(nn.Module):
    """Sinusoidal positions of "Attention Is All You Need", kept as a buffer
    `pe` (max_len, d_model) so that the checkpoint carries the exact table."""

    def __init__(self, d_model, max_len):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)


class DateTranslator(nn.Module):
    """Embeddings (scaled by sqrt(d_model)) + positions -> nn.Transformer ->
    `generator` linear to target logits. Batch first."""

    def __init__(self, cfg):
        super().__init__()
        t = cfg["transformer"]
        d = t["d_model"]
        self.d_model = d
        self.src_embed = nn.Embedding(cfg["src_vocab_size"], d)
        self.tgt_embed = nn.Embedding(cfg["tgt_vocab_size"], d)
        self.pos_encoding = PositionalEncoding(d, cfg["max_positions"])
        self.transformer = nn.Transformer(
            d_model=d,
            nhead=t["nhead"],
            num_encoder_layers=t["num_encoder_layers"],
            num_decoder_layers=t["num_decoder_layers"],
            dim_feedforward=t["dim_feedforward"],
            dropout=t["dropout"],
            activation=t["activation"],
            layer_norm_eps=t["layer_norm_eps"],
            batch_first=True,
            norm_first=t["norm_first"],
        )
        self.generator = nn.Linear(d, cfg["tgt_vocab_size"])
        # N(0, 1/d) embeddings, so that after the sqrt(d) scale tokens and
        # positions have the same magnitude (with nn.Embedding's N(0, 1) the
        # positions drown and the model cannot tell where a digit is).
        for table in (self.src_embed, self.tgt_embed):
            nn.init.normal_(table.weight, std=d**-0.5)
        self.drop = nn.Dropout(t["dropout"])

    def embed(self, table, ids):
        x = table(ids) * math.sqrt(self.d_model) + self.pos_encoding.pe[: ids.shape[1]]
        return self.drop(x)

    def encode(self, src):
        pad = src == PAD
        return self.transformer.encoder(self.embed(self.src_embed, src), src_key_padding_mask=pad), pad

    def decode(self, tgt, memory, src_pad):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.transformer.decoder(
            self.embed(self.tgt_embed, tgt),
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=src_pad,
        )
        return self.generator(out)

    def forward(self, src, tgt_in):
        memory, pad = self.encode(src)
        return self.decode(tgt_in, memory, pad)

    @torch.no_grad()
    def greedy(self, src, max_len):
        """Full re-decode at each step (no cache): the plain reference."""
        memory, pad = self.encode(src)
        ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long)
        done = torch.zeros(src.shape[0], dtype=torch.bool)
        for _ in range(max_len):
            nxt = self.decode(ys, memory, pad)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == EOS
            if done.all():
                break
        return ys[:, 1:]


def encode_batch(texts, table):
    n = max(len(t) for t in texts)
    return torch.tensor([[table[c] for c in t] + [PAD] * (n - len(t)) for t in texts])


def decode_ids(ids, chars):
    out = []
    for i in ids:
        if i == EOS or i == PAD:
            break
        out.append(chars[i] if i >= len(SPECIALS) else "")
    return "".join(out)


def load_init(model, init_dir, src_chars):
    """Starts from a previous model in `init_dir`: every tensor of the same
    shape is copied, and the source embedding row of every character both
    vocabularies have. New characters and the prefixes keep their fresh
    initialisation."""
    from safetensors.torch import load_file

    old = load_file(os.path.join(init_dir, "model.safetensors"))
    with open(os.path.join(init_dir, "vocab.json"), encoding="utf-8") as f:
        old_src = json.load(f)["src"]
    state = model.state_dict()
    copied = 0
    for k, v in old.items():
        if k == "src_embed.weight":
            rows = {c: i for i, c in enumerate(old_src)}
            for i, c in enumerate(src_chars):
                if c in rows:
                    state[k][i] = v[rows[c]]
            copied += 1
        elif k in state and state[k].shape == v.shape:
            state[k].copy_(v)
            copied += 1
    model.load_state_dict(state)
    print(f"initialised {copied}/{len(state)} tensors from {init_dir}")


def evaluate(model, examples, src_table, tgt_chars, max_len):
    """PyTorch's greedy outputs for (prefix, text) pairs, 100 at a time."""
    outputs = []
    for i in range(0, len(examples), 100):
        chunk = examples[i : i + 100]
        ys = model.greedy(encode_batch([[p] + list(s) for p, s in chunk], src_table), max_len)
        outputs += [decode_ids(row.tolist(), tgt_chars) for row in ys]
    return outputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--heldout", type=int, default=1800, help="held-out examples, 200 per family")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--init", help="start from the model in this folder (fine-tuning)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop training after this long even if steps remain")
    ap.add_argument("--force", action="store_true",
                    help="write the model even if it does worse than the one in --out on its held-out set")
    args = ap.parse_args()

    random.seed(0)
    torch.manual_seed(0)
    # One thread: reproducible, and faster than two on a busy 2-core machine.
    torch.set_num_threads(1)
    # First use of the seeded generator: the same split of dates as every
    # earlier version of this script, so the previous held-out dates stay
    # unseen.
    days = [FIRST + dt.timedelta(n) for n in range((LAST - FIRST).days + 1)]
    random.shuffle(days)

    src_chars = SPECIALS[:1] + [MONTH_FIRST, DAY_FIRST] + source_chars()
    tgt_chars = SPECIALS + TGT_CHARS
    src_table = {c: i for i, c in enumerate(src_chars)}
    tgt_table = {c: i for i, c in enumerate(tgt_chars)}
    cfg = {
        "transformer": {
            "d_model": 64,
            "nhead": 4,
            "num_encoder_layers": 2,
            "num_decoder_layers": 2,
            "dim_feedforward": 256,
            "dropout": 0.1,
            "activation": "gelu",
            "layer_norm_eps": 1e-5,
            "batch_first": True,
            "norm_first": True,
            "bias": True,
        },
        "src_vocab_size": len(src_chars),
        "tgt_vocab_size": len(tgt_chars),
        "max_positions": 64,
        # The prefix and up to 60 characters.
        "max_src_len": 61,
        "max_tgt_len": 11,
        "pad_id": PAD,
        "bos_id": BOS,
        "eos_id": EOS,
        "scale_embeddings": True,
    }

    n_held = len(days) // 10
    held_days, train_days = days[:n_held], days[n_held:]
    per_family = max(1, args.heldout // len(FAMILIES))
    heldout = []
    for fi, family in enumerate(FAMILIES):
        for d in held_days[fi * per_family : (fi + 1) * per_family]:
            fam, prefix, text = render(d, family)
            heldout.append((fam, prefix, text, iso(d)))
    assert max(len(t) for _, _, t, _ in heldout) < cfg["max_src_len"]

    # The previous model's held-out set (same split of dates, seed 0), read
    # under the convention it was trained with: the new model must not do
    # worse on it.
    legacy = []
    legacy_path = os.path.join(args.out, "heldout.json")
    if os.path.exists(legacy_path):
        with open(legacy_path, encoding="utf-8") as f:
            old = json.load(f)
        for e in old["examples"]:
            if e.get("family", "legacy") != "legacy":
                continue
            prefix = e.get("prefix") or (DAY_FIRST if legacy_day_first(e["input"]) else MONTH_FIRST)
            legacy.append((prefix, e["input"], e["target"], e["pytorch"]))
    legacy_prev = sum(o == a for _, _, a, o in legacy)

    model = DateTranslator(cfg)
    if args.init:
        load_init(model, args.init, src_chars)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params} parameters, src vocab {len(src_chars)}, tgt vocab {len(tgt_chars)}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, min(200, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))),
    )
    t0 = time.time()
    steps_done = 0
    for step in range(args.steps):
        model.train()
        batch = [random.choice(train_days) for _ in range(args.batch)]
        rendered = [render(d) for d in batch]
        src = encode_batch([[p] + list(s) for _, p, s in rendered], src_table)
        tgt = torch.tensor([[BOS] + [tgt_table[c] for c in iso(d)] + [EOS] for d in batch])
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        steps_done = step + 1
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if args.max_seconds is not None and time.time() - t0 > args.max_seconds:
            print(f"stopping after {steps_done} steps: --max-seconds {args.max_seconds}")
            break

    model.eval()
    outputs = evaluate(model, [(p, s) for _, p, s, _ in heldout], src_table, tgt_chars, cfg["max_tgt_len"])
    print("held-out exact match by format family (PyTorch, greedy):")
    by_family = {}
    for (fam, _, _, a), o in zip(heldout, outputs):
        c, n = by_family.get(fam, (0, 0))
        by_family[fam] = (c + (o == a), n + 1)
    for fam, (c, n) in by_family.items():
        print(f"  {fam:14s} {c:4d}/{n} = {c / n:.4f}")
    correct = sum(o == a for o, (_, _, _, a) in zip(outputs, heldout))
    acc = correct / len(heldout)
    print(f"  {'all':14s} {correct:4d}/{len(heldout)} = {acc:.4f}")
    legacy_out = evaluate(model, [(p, s) for p, s, _, _ in legacy], src_table, tgt_chars, cfg["max_tgt_len"])
    legacy_correct = sum(o == a for o, (_, _, a, _) in zip(legacy_out, legacy))
    print(f"previous held-out set: {legacy_correct}/{len(legacy)} (previous model {legacy_prev}/{len(legacy)})")
    rejected = legacy_correct < legacy_prev and not args.force

    # Everything goes to a temporary folder beside the output first, and
    # replaces the shipped files only once all of them are written (and
    # the model is not worse than the one it replaces).
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".train-dates-", dir=os.path.dirname(os.path.abspath(args.out)))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({"src": src_chars, "tgt": tgt_chars}, f, ensure_ascii=False, indent=1)
    examples = [
        {"family": fam, "prefix": p, "input": s, "target": a, "pytorch": o}
        for (fam, p, s, a), o in zip(heldout, outputs)
    ] + [
        {"family": "legacy", "prefix": p, "input": s, "target": a, "pytorch": o}
        for (p, s, a, _), o in zip(legacy, legacy_out)
    ]
    with open(os.path.join(tmp, "heldout.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "pytorch_exact_match": acc,
                "pytorch_exact_match_by_family": {f: c / n for f, (c, n) in by_family.items()},
                "pytorch_exact_match_previous_set": legacy_correct / max(1, len(legacy)),
                "steps": steps_done,
                "examples": examples,
            },
            f,
            ensure_ascii=False,
            indent=0,
        )
    if rejected:
        raise SystemExit(
            f"worse than the previous model on its held-out set: {args.out} left as it was; "
            f"this model is in {tmp} (--force to replace)"
        )
    for name in ("model.safetensors", "config.json", "vocab.json", "heldout.json"):
        os.replace(os.path.join(tmp, name), os.path.join(args.out, name))
    os.rmdir(tmp)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
