//! What a weights file is and what it holds.

mod layout;

pub use layout::{recognise, DecoderFacts, Layout, MhaFacts, TransformerFacts, VitFacts};
