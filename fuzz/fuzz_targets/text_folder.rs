//! Any bytes as one text file of a decoder folder, the first byte choosing
//! which (`tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json` or `chat_template.jinja`), the committed llama3
//! text fixture's others; what loads continues a short prompt and a short
//! conversation, and their streamed pieces must add up to their text.
#![no_main]

use candle::Device;
use libfuzzer_sys::fuzz_target;
use multihead_models::checkpoint::Checkpoint;
use multihead_models::decoder::{
    ChatMessage, ChatTemplate, DecoderModel, GenerationSettings, HfDecoderConfig, HfGenerationConfig,
    TextGenerator, TextTokenizer,
};

static CONFIG: &str = include_str!("../../tests/fixtures/text/llama3/config.json");
static WEIGHTS: &[u8] = include_bytes!("../../tests/fixtures/text/llama3/model.safetensors");
static TOKENIZER: &[u8] = include_bytes!("../../tests/fixtures/text/llama3/tokenizer.json");
static TOKENIZER_CONFIG: &str = include_str!("../../tests/fixtures/text/llama3/tokenizer_config.json");
static GENERATION: &str = include_str!("../../tests/fixtures/text/llama3/generation_config.json");
static CHAT: &str = include_str!("../../tests/fixtures/text/llama3/chat_template.jinja");

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = std::str::from_utf8(rest).unwrap_or("");
    let (tokenizer, tokenizer_config, generation, chat) = match which % 4 {
        0 => (rest, TOKENIZER_CONFIG, GENERATION, CHAT),
        1 => (TOKENIZER, text, GENERATION, CHAT),
        2 => (TOKENIZER, TOKENIZER_CONFIG, text, CHAT),
        _ => (TOKENIZER, TOKENIZER_CONFIG, GENERATION, text),
    };
    let special = [("bos_token".to_string(), "<|begin_of_text|>".to_string())].into();
    let Ok(chat) = ChatTemplate::new(chat.to_string(), "chat_template.jinja", special) else {
        return;
    };
    let Ok(tok) = TextTokenizer::from_json(tokenizer, "tokenizer.json", Some((tokenizer_config, "tokenizer_config.json")))
    else {
        return;
    };
    let Ok(gen) = HfGenerationConfig::from_json(generation, "generation_config.json") else {
        return;
    };
    let (Ok(cfg), Ok(ckpt)) = (
        HfDecoderConfig::from_json(CONFIG, "config.json"),
        Checkpoint::from_bytes(WEIGHTS.to_vec(), "model.safetensors"),
    ) else {
        return;
    };
    let Ok(model) = DecoderModel::from_checkpoint(&cfg, &ckpt, &Device::Cpu) else {
        return;
    };
    let Ok(g) = TextGenerator::new(model, tok, gen, "fuzz") else {
        return;
    };
    let g = g.with_chat_template(Some(chat));
    let settings = GenerationSettings {
        max_new_tokens: 4,
        ..g.settings()
    };
    let mut pieces = String::new();
    if let Ok(out) = g.generate("Hello wörld", &settings, &mut |p| {
        pieces.push_str(p);
        Ok(())
    }) {
        assert_eq!(pieces, out.text);
    }
    let messages = [ChatMessage::new("system", " Be brief. "), ChatMessage::new("user", "héllo")];
    let mut pieces = String::new();
    if let Ok(out) = g.generate_chat(&messages, &settings, &mut |p| {
        pieces.push_str(p);
        Ok(())
    }) {
        assert_eq!(pieces, out.text);
    }
});
