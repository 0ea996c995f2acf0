//! One module per subcommand.
pub mod common;
pub mod eval;
pub mod tokenize;
