//! Any bytes as a `tokenizer.json`, read as a decoder folder's tokenizer
//! (`TextTokenizer::from_json`, which fences the tokenizers crate: its
//! panics and a normalizer's growth); what loads encodes a few texts,
//! decodes ids from the input's tail, and streams them: the pieces must
//! add up to the decoded text. The committed fixtures' `tokenizer.json`
//! files are the seeds (see docs/untrusted.md).
#![no_main]

use libfuzzer_sys::fuzz_target;
use multihead_models::decoder::TextTokenizer;

fuzz_target!(
    init: {
        // The text side catches its dependencies' panics on untrusted input
        // at its boundary (the tokenizers crate's calls, MiniJinja's
        // rendering thread); libfuzzer-sys's hook would abort on those too.
        // A panic that escapes still aborts: it cannot unwind out of the
        // fuzzer's C entry point (FUZZ_SHOW_PANICS=1 prints every panic).
        std::panic::set_hook(Box::new(|info| {
            if std::env::var_os("FUZZ_SHOW_PANICS").is_some() {
                eprintln!("{info}");
            }
        }));
    },
    |data: &[u8]| {
        let Ok(tok) = TextTokenizer::from_json(data, "tokenizer.json", None) else {
            return;
        };
        for text in [
            "Hello wörld",
            "",
            " a  b ",
            "日本語 🙂 <|eot_id|> <s>",
            "\u{FDFA}x",
        ] {
            let _ = tok.encode(text);
            let _ = tok.encode_plain(text);
        }
        let vocab = tok.vocab_size().max(1) as u32;
        let ids: Vec<u32> = data
            .rchunks(2)
            .take(64)
            .map(|c| c.iter().fold(0u32, |a, &b| a << 8 | u32::from(b)) % (vocab + 2))
            .collect();
        let Ok(text) = tok.decode(&ids) else {
            return;
        };
        let mut stream = tok.stream();
        let mut pieces = String::new();
        for &id in &ids {
            match stream.push(id) {
                Ok(piece) => pieces.push_str(&piece.unwrap_or_default()),
                Err(_) => return,
            }
        }
        if let Ok(rest) = stream.finish() {
            pieces.push_str(&rest);
            assert_eq!(pieces, text);
        }
    }
);
