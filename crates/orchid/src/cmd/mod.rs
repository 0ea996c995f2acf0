//! One module per subcommand.
pub mod bench;
pub mod bench_batch;
pub mod chat;
pub mod common;
pub mod env_options;
pub mod eval;
pub mod presets;
pub mod quantize;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
