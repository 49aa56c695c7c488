//! What the tests of the multihead crates and of the `multihead` binary
//! share: the committed fixtures and how to read them, random inputs,
//! error measures, the checks on refusals, scratch folders and the
//! binary's runner. A dev-dependency only (`publish = false`); every crate
//! of the workspace names it by path alone, so `cargo package` leaves it
//! out of the packed manifests, as the packed crates leave out `tests/`.
//!
//! Two helpers read what cargo sets only while it compiles an integration
//! test, and so are macros expanded in the test: [`scratch_dir!`]
//! (`CARGO_TARGET_TMPDIR`) and [`multihead!`] (`CARGO_BIN_EXE_multihead`).

pub mod cli;
pub mod compare;
pub mod errors;
pub mod fixtures;
pub mod gguf;
pub mod random;
pub mod scratch;
pub mod shipped;
pub mod text;
pub mod tokens;
pub mod weights;
