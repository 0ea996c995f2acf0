//! orchid-model: config, checkpoints and the forward pass of the Qwen3.5/3.6-MoE and
//! Qwen3-Next family, written once against the [`backend::Backend`] trait.

pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod dtype;
pub mod error;
pub mod fast_decode;
pub mod linear;
pub mod model;
pub mod quant;
pub mod safetensors;
pub mod storage;
pub mod weights;
pub mod writer;

pub use backend::{Backend, StateOptions, StatePool};
pub use batch::{BatchLayout, LogitRows, SeqSpan};
pub use config::{LayerKind, ModelConfig};
pub use error::{Error, LoadError, Result};
pub use fast_decode::{
    DecodeStep, DeviceSampling, FastDecode, LateInputs, LogitAdjust, Sampled, TokenLogprob, TokenMasks, apply_logit_adjust,
};
pub use model::Model;

/// Reads a checkpoint folder (config + weights) and uploads it to `backend`.
pub fn load_model<B: Backend>(dir: &std::path::Path, backend: B) -> Result<Model<B>> {
    let config = ModelConfig::load(dir)?;
    let ck = checkpoint::Checkpoint::open(dir)?;
    let host = weights::load(&config, &ck)?;
    ck.check_finite()?;
    Model::new(config, backend, &host)
}
