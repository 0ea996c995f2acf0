//! Running the server: listen, announce, shut down cleanly.
//!
//! Shutdown (SIGINT/SIGTERM, or the caller's future): the listener closes and new requests on
//! open connections get 503; running requests may finish for `shutdown_grace`, after which
//! (or at a second signal) the engine cancels them (streams end with an error event,
//! non-streaming requests get 503). When the last connection has closed the engine thread is
//! joined and `serve` returns.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Result, anyhow};
use orchid_engine::engine::ModelInfo;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use crate::routes::router;
use crate::state::AppState;

/// Serves until SIGINT or SIGTERM (a second signal cancels running requests at once).
pub async fn serve(listener: TcpListener, st: AppState) -> Result<()> {
    let hurry = Arc::new(Notify::new());
    let hurry2 = hurry.clone();
    let first = async move {
        os_signal().await;
        tracing::info!("shutdown signal received; no new requests, finishing running ones (a second signal cancels them)");
        tokio::spawn(async move {
            os_signal().await;
            hurry2.notify_one();
        });
    };
    serve_until(listener, st, first, hurry).await
}

/// Serves until `shutdown` completes (then as described in the module docs).
pub async fn serve_with_shutdown(listener: TcpListener, st: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    serve_until(listener, st, shutdown, Arc::new(Notify::new())).await
}

async fn serve_until(
    listener: TcpListener,
    st: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
    hurry: Arc<Notify>,
) -> Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        "listening on http://{addr} (loading {} from {})",
        st.config.model_id,
        st.config.model_path
    );

    // Stop: set by a shutdown request, or by a failed model load.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let load_error: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    {
        let (st, stop_tx, load_error) = (st.clone(), stop_tx.clone(), load_error.clone());
        tokio::spawn(async move {
            let engine = st.engine.clone();
            match tokio::task::spawn_blocking(move || engine.wait_ready()).await {
                Ok(Ok(info)) => announce(&st, &info, addr),
                Ok(Err(e)) => {
                    tracing::error!("loading the model failed: {e}");
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    let _ = stop_tx.send(true);
                }
                Err(e) => {
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("model loader crashed: {e}"));
                    let _ = stop_tx.send(true);
                }
            }
        });
    }
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
    }
    // After the stop: a grace period (or a second signal), then cancel what still runs.
    {
        let (st, mut rx) = (st.clone(), stop_rx.clone());
        tokio::spawn(async move {
            let _ = rx.wait_for(|s| *s).await;
            st.begin_shutdown();
            tokio::select! {
                _ = tokio::time::sleep(st.config.shutdown_grace) => {}
                _ = hurry.notified() => {}
            }
            if st.engine.info().is_some() {
                tracing::info!("cancelling the requests still running");
                let engine = st.engine.clone();
                let _ = tokio::task::spawn_blocking(move || engine.shutdown(false)).await;
            }
        });
    }

    let app = router(st.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        })
        .await?;

    st.begin_shutdown();
    if st.engine.info().is_some() {
        let engine = st.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(true)).await;
    }
    if let Some(e) = load_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(anyhow!("the model could not be loaded: {e}"));
    }
    tracing::info!("server stopped");
    Ok(())
}

/// The startup line: what was loaded, where, how much memory, where it listens.
fn announce(st: &AppState, info: &ModelInfo, addr: SocketAddr) {
    let o = st.engine.options();
    tracing::info!(
        "ready: serving `{}` ({}, {} layers, vocab {}) on {}, {:.1} MiB of weights, context {} tokens, {} concurrent sequences, queue {}; listening on http://{addr}",
        st.config.model_id,
        st.config.model_path,
        info.num_layers,
        info.vocab_size,
        info.device,
        info.weight_bytes as f64 / (1024.0 * 1024.0),
        info.max_context,
        o.max_seqs,
        o.max_queue,
    );
}

/// Resolves at SIGINT or SIGTERM.
async fn os_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
