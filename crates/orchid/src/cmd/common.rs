//! What several subcommands share: locating the model, choosing the device, loading.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use orchid_cpu::CpuBackend;
use orchid_model::Model;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// The model folder: the argument, else the small model that ships with orchid.
pub fn model_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        if !p.is_dir() {
            bail!("model folder {} does not exist", p.display());
        }
        return Ok(p.to_path_buf());
    }
    default_model_dir().context("no --model given and the bundled model was not found")
}

/// `models/orchid-tiny` next to the executable's repository, or under $ORCHID_HOME.
pub fn default_model_dir() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(home) = std::env::var("ORCHID_HOME") {
        candidates.push(PathBuf::from(home).join("models/orchid-tiny"));
    }
    if let Ok(exe) = std::env::current_exe() {
        // target/release/orchid -> repository root
        for anc in exe.ancestors().skip(1).take(4) {
            candidates.push(anc.join("models/orchid-tiny"));
        }
    }
    candidates.push(PathBuf::from("models/orchid-tiny"));
    candidates.into_iter().find(|p| p.join("config.json").is_file())
}

pub fn load_cpu(dir: &Path) -> Result<Model<CpuBackend>> {
    let t = std::time::Instant::now();
    let m = orchid_model::load_model(dir, CpuBackend::new())?;
    tracing::info!(
        "loaded {} ({} layers, {:.1} MB of weights) on {} in {:.2}s",
        dir.display(),
        m.config.num_layers(),
        m.weight_bytes as f64 / 1e6,
        orchid_model::Backend::describe(&m.backend),
        t.elapsed().as_secs_f64()
    );
    Ok(m)
}

/// Resolves `auto` and rejects what this build cannot run.
pub fn resolve_device(d: Device) -> Result<Device> {
    match d {
        Device::Auto | Device::Cpu => Ok(Device::Cpu),
        Device::Cuda => bail!("this build has no CUDA backend yet"),
    }
}
