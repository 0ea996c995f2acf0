//! Request ids and the access log.
//!
//! Every response carries an `X-Request-Id`: the client's own (when it is 1-128 visible ASCII
//! characters) or a fresh one. Every request writes one access-log line (target
//! `orchid::access`) when it is completely done, that is when a streamed body has ended too:
//! method, route, status, prompt and completion tokens, time to first token, duration, and
//! the request id. Log lines written while handling the request carry the id as well (a
//! `request` span).

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

tokio::task_local! {
    /// The log record of the request being handled (set around each handler).
    static CURRENT: Arc<RequestLog>;
}

/// What the access-log line reports; shared by the handler's generations, written on drop.
pub struct RequestLog {
    id: String,
    method: String,
    route: String,
    started: Instant,
    status: AtomicU16,
    prompt_tokens: AtomicUsize,
    /// Prompt tokens restored from the prefix cache.
    cached_tokens: AtomicUsize,
    completion_tokens: AtomicUsize,
    /// Nanoseconds from arrival to the first generated token (0: none).
    ttft_ns: AtomicU64,
}

impl RequestLog {
    /// The record of the request being handled on this task, if any.
    pub fn current() -> Option<Arc<RequestLog>> {
        CURRENT.try_with(Arc::clone).ok()
    }

    pub fn prompt(&self, n: usize) {
        self.prompt_tokens.store(n, Ordering::Relaxed);
    }

    pub fn first_token(&self) {
        let ns = self.started.elapsed().as_nanos().clamp(1, u64::MAX as u128) as u64;
        let _ = self.ttft_ns.compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub fn completion(&self, n: usize) {
        self.completion_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub fn cached(&self, n: usize) {
        self.cached_tokens.fetch_add(n, Ordering::Relaxed);
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let ttft = match self.ttft_ns.load(Ordering::Relaxed) {
            0 => "-".to_string(),
            ns => format!("{:.1}ms", ns as f64 / 1e6),
        };
        tracing::info!(
            target: "orchid::access",
            "{} {} {} prompt_tokens={} cached_tokens={} completion_tokens={} ttft={} duration={:.1}ms request_id={}",
            self.method,
            self.route,
            self.status.load(Ordering::Relaxed),
            self.prompt_tokens.load(Ordering::Relaxed),
            self.cached_tokens.load(Ordering::Relaxed),
            self.completion_tokens.load(Ordering::Relaxed),
            ttft,
            self.started.elapsed().as_secs_f64() * 1e3,
            self.id,
        );
    }
}

/// The client's request id when it is usable as one.
fn client_id(req: &Request) -> Option<String> {
    let v = req.headers().get(&REQUEST_ID)?.to_str().ok()?;
    let ok = !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| v.to_string())
}

/// Middleware: request id in, request id out, one access-log line per request.
pub async fn middleware(req: Request, next: Next) -> Response {
    let id = client_id(&req).unwrap_or_else(|| crate::openai::new_id("req-"));
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let log = Arc::new(RequestLog {
        id: id.clone(),
        method: req.method().to_string(),
        route,
        started: Instant::now(),
        status: AtomicU16::new(0),
        prompt_tokens: AtomicUsize::new(0),
        cached_tokens: AtomicUsize::new(0),
        completion_tokens: AtomicUsize::new(0),
        ttft_ns: AtomicU64::new(0),
    });
    let span = tracing::info_span!("request", id = %id);
    let mut resp = CURRENT.scope(log.clone(), next.run(req)).instrument(span).await;
    log.status.store(resp.status().as_u16(), Ordering::Relaxed);
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID.clone(), v);
    }
    resp
}
