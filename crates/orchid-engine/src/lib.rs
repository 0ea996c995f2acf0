//! orchid-engine: everything between the HTTP surface and the model.
//!
//! - [`tokenizer`]: `tokenizer.json` + the special ids (eos set, think/tool-call markers).
//! - [`chat_template`]: HF chat templates rendered with minijinja, byte-identical to transformers.
//! - [`detokenize`]: streaming token ids back to text without splitting characters.
//! - [`constraint`]: grammar-constrained decoding (JSON schema, regex, choice, Lark) with llguidance.

pub mod chat_template;
pub mod constraint;
pub mod defaults;
pub mod detokenize;
pub mod engine;
pub mod prefix_cache;
pub mod request;
pub mod sampling;
pub mod sampling_limits;
pub mod stop;
pub mod tokenizer;

pub use chat_template::{ChatTemplate, ChatTemplateError};
pub use detokenize::Detokenizer;
pub use tokenizer::{MarkerIds, Tokenizer};
