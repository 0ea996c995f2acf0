//! The Qwen3.5/3.6-MoE / Qwen3-Next forward pass, written once for every backend.
//!
//! ```text
//! x = embed(ids)
//! for each layer:  h = x + Mixer(RMSNorm_in(x));  x = h + FFN(RMSNorm_post(h))
//! logits = lm_head(RMSNorm_final(x))
//! ```
//! This is the only code that knows the layer order, where the norms sit and where the residual
//! adds are. It is written with the backend's fusions of those patterns (`norm_matmuls`: a
//! block's input projections; `matmul_add`: its output projection onto the residual; `moe_block`:
//! the whole MoE half, told the norm the next block starts with), so a backend fuses them without
//! a second copy of the walk; on CUDA a batched decode step is a capture of this function
//! (`orchid_cuda::BatchGraph`).
//! Mixer is gated full attention (every 4th layer in the real models) or Gated DeltaNet; FFN
//! is the sparse MoE (or a dense SwiGLU MLP on Qwen3-Next's optional dense layers).

mod attention;
mod deltanet;
mod ffn;

pub use attention::Attention;
pub use deltanet::GatedDeltaNet;
pub use ffn::Ffn;

use crate::backend::{Backend, StateOptions};
use crate::batch::{BatchLayout, LogitRows};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::weights::{HostMixer, HostWeights};

pub enum Mixer<B: Backend> {
    Attention(Attention<B>),
    DeltaNet(GatedDeltaNet<B>),
}

pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: B::Vector,
    pub post_attention_layernorm: B::Vector,
    pub mixer: Mixer<B>,
    pub ffn: Ffn<B>,
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub backend: B,
    pub embed_tokens: B::Linear,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: B::Vector,
    pub lm_head: B::Linear,
    /// Bytes of weights as loaded (for logs and benchmarks).
    pub weight_bytes: usize,
}

impl<B: Backend> Model<B> {
    /// Uploads canonical host weights to the backend.
    pub fn new(config: ModelConfig, backend: B, w: &HostWeights) -> Result<Model<B>> {
        let b = &backend;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, l) in w.layers.iter().enumerate() {
            let mixer = match &l.mixer {
                HostMixer::Attention(a) => Mixer::Attention(Attention::new(b, a, config.kind_index(i))?),
                HostMixer::DeltaNet(d) => Mixer::DeltaNet(GatedDeltaNet::new(b, d, config.kind_index(i))?),
            };
            layers.push(DecoderLayer {
                input_layernorm: b.upload_vector(&l.input_norm)?,
                post_attention_layernorm: b.upload_vector(&l.post_norm)?,
                mixer,
                ffn: Ffn::new(b, &l.ffn)?,
            });
        }
        Ok(Model {
            embed_tokens: b.upload_linear(&w.embed)?,
            norm: b.upload_vector(&w.final_norm)?,
            lm_head: b.upload_linear(&w.lm_head)?,
            layers,
            weight_bytes: w.nbytes(),
            config,
            backend,
        })
    }

    pub fn new_state(&self, opts: StateOptions) -> Result<B::State> {
        self.backend.new_state(&self.config, opts)
    }

    /// Runs the tokens `ids` (laid out by `batch`) through the model, updating each span's
    /// state, and returns logits [rows, vocab] for the rows `rows` selects.
    pub fn forward(&self, ids: &[u32], batch: &BatchLayout, state: &mut B::State, rows: LogitRows) -> Result<B::Tensor> {
        let b = &self.backend;
        let eps = self.config.rms_norm_eps;
        if ids.len() != batch.num_tokens() || ids.is_empty() {
            return Err(Error::Op { op: "forward", msg: format!("{} ids for a batch of {} tokens", ids.len(), batch.num_tokens()) });
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            return Err(Error::Op { op: "forward", msg: format!("token id {bad} is outside the vocabulary ({})", self.config.vocab_size) });
        }
        // Spans of one token each (decode): their last rows are all the rows.
        let select = matches!(rows, LogitRows::LastOfEachSpan) && batch.spans.iter().any(|s| s.len > 1);
        let mut x = b.embed(&self.embed_tokens, ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Attention(a) => a.forward(b, &mut x, &layer.input_layernorm, &self.config, batch, state)?,
                Mixer::DeltaNet(d) => d.forward(b, &mut x, &layer.input_layernorm, &self.config, batch, state)?,
            }
            // The norm the rows of x meet next: the next layer's, or the final one unless only
            // some rows go on to the lm_head.
            let next = match self.layers.get(i + 1) {
                Some(l) => Some(&l.input_layernorm),
                None => (!select).then_some(&self.norm),
            };
            layer.ffn.forward(b, &mut x, &layer.post_attention_layernorm, next, &self.config)?;
        }
        let x = if select { b.select_rows(&x, &batch.last_rows())? } else { x };
        let [logits] = attention::projections(b.norm_matmuls(&x, &self.norm, eps, &[&self.lm_head])?)?;
        Ok(logits)
    }
}
