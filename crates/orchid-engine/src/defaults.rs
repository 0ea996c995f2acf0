//! Sampling defaults from the checkpoint's `generation_config.json` (used when a request does
//! not set a parameter, as vLLM does).

use std::path::Path;

use serde_json::Value;

use crate::sampling::SamplingParams;

/// The checkpoint's recommended sampling, or greedy when it has none.
pub fn sampling_defaults(dir: &Path) -> SamplingParams {
    let mut p = SamplingParams::default();
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
        return p;
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return p;
    };
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    if v.get("do_sample").and_then(Value::as_bool) == Some(false) {
        return p;
    }
    if let Some(t) = f("temperature") {
        p.temperature = t as f32;
    } else if v.get("do_sample").and_then(Value::as_bool) == Some(true) {
        p.temperature = 1.0;
    }
    if let Some(x) = f("top_p") {
        p.top_p = x as f32;
    }
    if let Some(x) = f("top_k") {
        p.top_k = x as usize;
    }
    if let Some(x) = f("min_p") {
        p.min_p = x as f32;
    }
    if let Some(x) = f("repetition_penalty") {
        p.repetition_penalty = x as f32;
    }
    p
}
