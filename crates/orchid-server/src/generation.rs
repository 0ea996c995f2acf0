//! One running generation as the handlers see it: the engine's event receiver plus latency
//! bookkeeping. Dropping it drops the receiver, which cancels the request in the engine and
//! frees its sequence slot (a client that disconnects drops the response body, which owns
//! this).

use std::sync::Arc;
use std::time::Instant;

use orchid_engine::request::Event;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::access_log::RequestLog;
use crate::state::AppState;

pub struct Generation {
    rx: UnboundedReceiver<Event>,
    st: AppState,
    arrived: Instant,
    last_token: Option<Instant>,
    pub prompt_tokens: usize,
    /// Set once the engine sent `Finished` or `Error`.
    ended: bool,
    /// Set once the handler recorded how the response ended.
    recorded: bool,
    /// The access-log record of the HTTP request this generation serves.
    log: Option<Arc<RequestLog>>,
}

impl Generation {
    pub(crate) fn new(rx: UnboundedReceiver<Event>, st: AppState, arrived: Instant, prompt_tokens: usize) -> Generation {
        let log = RequestLog::current();
        if let Some(l) = &log {
            l.prompt(prompt_tokens);
        }
        Generation { log, rx, st, arrived, last_token: None, prompt_tokens, ended: false, recorded: false }
    }

    /// The next engine event; `None` after the last one. An engine that goes away without a
    /// final event reads as an error.
    pub async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let ev = self.rx.recv().await.unwrap_or_else(|| Event::Error("the engine stopped unexpectedly".into()));
        let now = Instant::now();
        let m = &self.st.metrics;
        match &ev {
            Event::Token { .. } => {
                match self.last_token {
                    None => {
                        m.ttft.observe(now - self.arrived);
                        if let Some(l) = &self.log {
                            l.first_token();
                        }
                    }
                    Some(t) => m.itl.observe(now - t),
                }
                self.last_token = Some(now);
            }
            Event::Finished { usage, .. } => {
                self.ended = true;
                if let Some(l) = &self.log {
                    l.completion(usage.completion_tokens);
                    l.cached(usage.cached_tokens);
                }
                m.duration.observe(now - self.arrived);
            }
            Event::Error(_) => {
                self.ended = true;
                self.record("error");
            }
        }
        Some(ev)
    }

    /// Records how the response ended (`stop`, `length`, `tool_calls`), once.
    pub fn record(&mut self, reason: &'static str) {
        if !self.recorded {
            self.recorded = true;
            self.st.metrics.record_finish(reason);
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.ended {
            tracing::debug!("client went away; cancelling its generation");
            self.record("cancelled");
        }
    }
}
