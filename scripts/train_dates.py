#!/usr/bin/env python3
"""Train the character-level date normaliser that `multihead seq2seq` ships.

Dates written the ways people write them ("3rd of March 2021",
"03/03/21", "March 3, 2021", "2021年3月3日", "Wed 3 Mar 2021", ...) are
translated to ISO "2021-03-03" by a small `nn.Transformer` with character
embeddings, sinusoidal positions and an output projection (`DateTranslator`
below; the Rust side is `multihead_models::transformer::Seq2Seq`).

Conventions the data fixes, so that every input has one answer:
- years are 1950..=2049; a two-digit year `yy` is 20yy when yy < 50, else 19yy;
- slashes are month first (US: "03/03/21", "3/3/2021"), dots and dashes with
  a month number are day first (European: "03.03.2021", "3-3-2021"),
  a leading four-digit year is year-month-day ("2021/03/03", "20210303").

The held-out split is by date: no held-out date appears in training, in any
format.

Writes, in weights/dates/ (about 1.1 MB in all):
- model.safetensors: the state_dict, PyTorch's names, f32;
- config.json: the architecture and the special tokens (Seq2SeqConfig);
- vocab.json: source and target characters, by id;
- heldout.json: the held-out inputs, their ISO answers and PyTorch's greedy
  outputs (what tests/seq2seq_dates.rs compares against).

Regenerate (torch, safetensors; one thread, about 0.27 s a step, so ~11 minutes
on an idle 2-core machine, longer on a busy one):

    .venv-ref/bin/python scripts/train_dates.py
"""

import argparse
import datetime as dt
import json
import math
import os
import random
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

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<bos>", "<eos>"]
TGT_CHARS = list("0123456789-")


def ordinal(n):
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def month_abbr(m):
    # "Sept" is how many people abbreviate September; the rest are 3 letters.
    return "Sept" if m == 9 and random.random() < 0.3 else MONTHS[m - 1][:3]


def formats(d):
    """Every way this script writes the date `d`, as (name, text) pairs."""
    y, m, day = d.year, d.month, d.day
    mon, mo3, wd, wd3 = MONTHS[m - 1], month_abbr(m), DAYS[d.weekday()], DAYS[d.weekday()][:3]
    yy = y % 100
    return [
        ("long_us", f"{mon} {day}, {y}"),
        ("long_us_nocomma", f"{mon} {day} {y}"),
        ("long_eu", f"{day} {mon} {y}"),
        ("long_eu_comma", f"{day} {mon}, {y}"),
        ("ordinal_of", f"{ordinal(day)} of {mon} {y}"),
        ("the_ordinal_of", f"the {ordinal(day)} of {mon}, {y}"),
        ("ordinal_us", f"{mon} {ordinal(day)}, {y}"),
        ("short_eu", f"{day} {mo3} {y}"),
        ("short_us", f"{mo3} {day}, {y}"),
        ("short_dash", f"{day:02d}-{mo3}-{y}"),
        ("weekday_us", f"{wd}, {mon} {day}, {y}"),
        ("weekday_eu", f"{wd} {day} {mon} {y}"),
        ("weekday_short", f"{wd3} {day} {mo3} {y}"),
        ("weekday_ordinal", f"{wd}, the {ordinal(day)} of {mon} {y}"),
        ("us_slash_yy", f"{m:02d}/{day:02d}/{yy:02d}"),
        ("us_slash", f"{m}/{day}/{y}"),
        ("us_slash_pad", f"{m:02d}/{day:02d}/{y}"),
        ("eu_dot", f"{day:02d}.{m:02d}.{y}"),
        ("eu_dot_nopad", f"{day}.{m}.{y}"),
        ("eu_dot_yy", f"{day:02d}.{m:02d}.{yy:02d}"),
        ("eu_dash", f"{day}-{m}-{y}"),
        ("cjk", f"{y}年{m}月{day}日"),
        ("cjk_pad", f"{y}年{m:02d}月{day:02d}日"),
        ("ymd_slash", f"{y}/{m:02d}/{day:02d}"),
        ("ymd_compact", f"{y}{m:02d}{day:02d}"),
        ("iso", f"{y}-{m:02d}-{day:02d}"),
        ("upper", f"{mon.upper()} {day}, {y}"),
        ("lower", f"{day} {mon.lower()} {y}"),
    ]


def render(d):
    """One random way of writing `d`."""
    return random.choice(formats(d))[1]


def iso(d):
    return d.isoformat()


def source_chars():
    chars = set()
    for m in range(1, 13):
        for day in range(1, 8):
            for y in (1999, 2021):
                for _, s in formats(dt.date(y, m, day)):
                    chars.update(s)
    chars.update("0123456789")
    chars.update("Sept")
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=1000)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()

    random.seed(0)
    torch.manual_seed(0)
    # One thread: reproducible, and faster than two on a busy 2-core machine.
    torch.set_num_threads(1)

    src_chars = SPECIALS[:1] + source_chars()
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
        "max_src_len": 40,
        "max_tgt_len": 11,
        "pad_id": PAD,
        "bos_id": BOS,
        "eos_id": EOS,
        "scale_embeddings": True,
    }

    days = [FIRST + dt.timedelta(n) for n in range((LAST - FIRST).days + 1)]
    random.shuffle(days)
    n_held = len(days) // 10
    held_days, train_days = days[:n_held], days[n_held:]
    heldout = [(render(d), iso(d)) for d in held_days[: args.heldout]]
    assert max(len(s) for s, _ in heldout) <= cfg["max_src_len"]

    model = DateTranslator(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params} parameters, src vocab {len(src_chars)}, tgt vocab {len(tgt_chars)}")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    warmup = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))),
    )
    t0 = time.time()
    for step in range(args.steps):
        model.train()
        batch = [random.choice(train_days) for _ in range(args.batch)]
        src = encode_batch([render(d) for d in batch], src_table)
        tgt = torch.tensor([[BOS] + [tgt_table[c] for c in iso(d)] + [EOS] for d in batch])
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

    model.eval()
    outputs = []
    for i in range(0, len(heldout), 100):
        chunk = heldout[i : i + 100]
        ys = model.greedy(encode_batch([s for s, _ in chunk], src_table), cfg["max_tgt_len"])
        outputs += [decode_ids(row.tolist(), tgt_chars) for row in ys]
    correct = sum(o == a for o, (_, a) in zip(outputs, heldout))
    acc = correct / len(heldout)
    print(f"held-out exact match: {correct}/{len(heldout)} = {acc:.4f}")

    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(args.out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({"src": src_chars, "tgt": tgt_chars}, f, ensure_ascii=False, indent=1)
    with open(os.path.join(args.out, "heldout.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "pytorch_exact_match": acc,
                "examples": [
                    {"input": s, "target": a, "pytorch": o} for (s, a), o in zip(heldout, outputs)
                ],
            },
            f,
            ensure_ascii=False,
            indent=0,
        )


if __name__ == "__main__":
    main()
