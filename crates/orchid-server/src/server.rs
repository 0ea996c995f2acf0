//! Running the server: listen, announce, shut down cleanly.
//!
//! Shutdown (SIGINT/SIGTERM, or the caller's future): the listener closes and new requests on
//! open connections get 503; running requests may finish for `shutdown_grace`, after which
//! (or at a second signal) the engine cancels them (streams end with an error event,
//! non-streaming requests get 503). When the last connection has closed, or at the latest
//! [`CLOSE_MARGIN`] after the grace period whatever clients do, the engine thread is joined
//! and `serve` returns.
//!
//! Connections: at most `max_connections` are open at once (further clients wait in the
//! listen backlog); a client has `header_timeout` to send a request head, counted from when
//! the connection opened or its previous response ended (so it is also the idle keep-alive
//! timeout), and `body_timeout` to send the body.
//!
//! An engine that fails (its thread panicked) fails `/health` and ends `serve` with an error.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, anyhow};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use orchid_engine::engine::ModelInfo;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};

/// How long after the grace period connections still open are closed regardless.
pub const CLOSE_MARGIN: Duration = Duration::from_secs(1);

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
    tracing::info!("listening on http://{addr} (loading {} from {})", st.config.model_id, st.config.model_path);

    // Stop: set by a shutdown request, or by a failed model load.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let load_error: Arc<std::sync::Mutex<Option<anyhow::Error>>> = Arc::default();
    {
        let (st, stop_tx, load_error) = (st.clone(), stop_tx.clone(), load_error.clone());
        tokio::spawn(async move {
            let engine = st.engine.clone();
            match tokio::task::spawn_blocking(move || engine.wait_ready()).await {
                Ok(Ok(info)) => announce(&st, &info, addr),
                Ok(Err(e)) => {
                    tracing::error!("loading the model failed: {e}");
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.into_anyhow().context("the model could not be loaded"));
                    let _ = stop_tx.send(true);
                }
                Err(e) => {
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(anyhow!("model loader crashed: {e}"));
                    let _ = stop_tx.send(true);
                }
            }
        });
    }
    // An engine that stops working ends the server (after /health has said so).
    {
        let (st, stop_tx, load_error, mut stop_rx) = (st.clone(), stop_tx.clone(), load_error.clone(), stop_rx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = stop_rx.wait_for(|s| *s) => return,
                }
                if let Some(msg) = st.engine.failure() {
                    tracing::error!("the engine failed ({msg}); shutting down");
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(anyhow!("{msg}"));
                    // Give health checks a moment to see the failure.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let _ = stop_tx.send(true);
                    return;
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
    let limit = Arc::new(Semaphore::new(st.config.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    // HTTP/1.1 only: the HTTP/2 prior-knowledge detection waits for a first byte with no timeout,
    // which would let idle connections stay open forever.
    let mut builder = Builder::new(TokioExecutor::new()).http1_only();
    builder.http1().timer(TokioTimer::new()).header_read_timeout(st.config.header_timeout);
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => p.expect("the connection semaphore is never closed"),
            _ = stop_rx.wait_for(|s| *s) => break,
        };
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors and the like: wait a little instead of spinning.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop_rx.wait_for(|s| *s) => break,
        };
        let _ = tcp.set_nodelay(true);
        let conn = builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone())).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    // Connections close after their current request; requests end within the grace period (the
    // engine cancels what still runs then). Whatever clients do, stop waiting soon after.
    let open = graceful.count();
    if tokio::time::timeout(st.config.shutdown_grace + CLOSE_MARGIN, graceful.shutdown()).await.is_err() {
        tracing::warn!("closing the connections still open after the shutdown timeout ({open} were open at the stop)");
    }

    st.begin_shutdown();
    if st.engine.info().is_some() {
        let engine = st.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(true)).await;
    }
    if let Some(e) = load_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    tracing::info!("server stopped");
    Ok(())
}

/// The startup line: what was loaded, where, how much memory, where it listens.
fn announce(st: &AppState, info: &ModelInfo, addr: SocketAddr) {
    let o = st.engine.options();
    tracing::info!(
        "ready: serving `{}` ({}, {} layers, vocab {}) on {}, {:.1} MiB of weights, context {} tokens, {} concurrent sequences, queue {}, {} prompt tokens a step; listening on http://{addr}",
        st.config.model_id,
        st.config.model_path,
        info.num_layers,
        info.vocab_size,
        info.device,
        info.weight_bytes as f64 / (1024.0 * 1024.0),
        info.max_context,
        o.max_seqs,
        o.max_queue,
        info.max_batched_tokens,
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
