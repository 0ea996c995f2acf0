//! Server-sent events: each JSON chunk as a `data: {json}` event, then `data: [DONE]`.
//! A panic while producing a chunk ends the stream with an error event (the OpenAI envelope)
//! and `[DONE]` instead of tearing the connection down mid-event. A stream silent for
//! [`KEEPALIVE`] (a long prefill, a full queue) gets a `: keep-alive` comment, which SSE
//! clients ignore and which keeps proxies and load balancers from closing it.

use std::convert::Infallible;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures::{Future, Stream};
use serde_json::Value;

use crate::errors::ApiError;

/// Silence after which a stream gets a keep-alive comment.
pub const KEEPALIVE: Duration = Duration::from_secs(15);

/// A streaming response from a stream of JSON chunks. Dropping the response body (the client
/// went away) drops `chunks`.
pub fn sse_response(chunks: impl Stream<Item = Value> + Send + 'static) -> Response {
    sse_body(Events::new(Box::pin(chunks), true, KEEPALIVE))
}

/// Like [`sse_response`] for a stream of ready-made events (e.g. `event: NAME\ndata: ..`),
/// ending without `[DONE]` (the Responses and Anthropic formats have their own last event).
pub fn sse_events_response(events: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    let chunks = futures::StreamExt::map(events, Raw);
    sse_body(Events::new(Box::pin(chunks), false, KEEPALIVE))
}

/// A pre-formatted event.
struct Raw(Bytes);

fn sse_body<T: Chunk + 'static>(events: Events<T>) -> Response {
    let body = Body::from_stream(events);
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

/// One event's bytes.
pub fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// What an SSE body is made of: JSON chunks (`data: {json}`) or ready-made events.
trait Chunk: Send {
    fn into_bytes(self) -> Bytes;
}

impl Chunk for Value {
    fn into_bytes(self) -> Bytes {
        event(&self)
    }
}

impl Chunk for Raw {
    fn into_bytes(self) -> Bytes {
        self.0
    }
}

struct Events<T> {
    inner: Option<Pin<Box<dyn Stream<Item = T> + Send>>>,
    /// Send `data: [DONE]` at the end (OpenAI's streams).
    done: bool,
    done_sent: bool,
    keepalive: Pin<Box<tokio::time::Sleep>>,
    every: Duration,
}

impl<T> Events<T> {
    fn new(inner: Pin<Box<dyn Stream<Item = T> + Send>>, done: bool, every: Duration) -> Events<T> {
        Events { inner: Some(inner), done, done_sent: false, keepalive: Box::pin(tokio::time::sleep(every)), every }
    }
}

impl<T: Chunk> Stream for Events<T> {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(inner) = this.inner.as_mut() {
            match catch_unwind(AssertUnwindSafe(|| inner.as_mut().poll_next(cx))) {
                Ok(Poll::Pending) => {
                    if this.keepalive.as_mut().poll(cx).is_ready() {
                        this.keepalive.as_mut().reset(tokio::time::Instant::now() + this.every);
                        return Poll::Ready(Some(Ok(Bytes::from_static(b": keep-alive\n\n"))));
                    }
                    return Poll::Pending;
                }
                Ok(Poll::Ready(Some(v))) => {
                    this.keepalive.as_mut().reset(tokio::time::Instant::now() + this.every);
                    return Poll::Ready(Some(Ok(v.into_bytes())));
                }
                Ok(Poll::Ready(None)) => this.inner = None,
                Err(panic) => {
                    this.inner = None;
                    let err = ApiError::from_panic(panic.as_ref());
                    return Poll::Ready(Some(Ok(event(&err.to_json()))));
                }
            }
        }
        if this.done_sent || !this.done {
            return Poll::Ready(None);
        }
        this.done_sent = true;
        Poll::Ready(Some(Ok(Bytes::from_static(b"data: [DONE]\n\n"))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use serde_json::json;

    async fn body_text(resp: Response) -> String {
        let b = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
        String::from_utf8(b.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn events_then_done() {
        let resp = sse_response(futures::stream::iter(vec![json!({"a": 1}), json!({"b": "x\ny"})]));
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
        assert_eq!(body_text(resp).await, "data: {\"a\":1}\n\ndata: {\"b\":\"x\\ny\"}\n\ndata: [DONE]\n\n");
    }

    #[tokio::test]
    async fn silent_streams_get_keepalive_comments() {
        let slow = futures::stream::once(async {
            tokio::time::sleep(Duration::from_millis(250)).await;
            json!(1)
        });
        let text = body_text(sse_body(Events::new(Box::pin(slow), true, Duration::from_millis(100)))).await;
        assert_eq!(text, ": keep-alive\n\n: keep-alive\n\ndata: 1\n\ndata: [DONE]\n\n");
    }

    #[tokio::test]
    async fn panic_becomes_an_error_event() {
        let s = futures::stream::iter(0..3).map(|i| if i == 1 { panic!("chunk {i} exploded") } else { json!(i) });
        let text = body_text(sse_response(s)).await;
        assert!(text.starts_with("data: 0\n\ndata: {\"error\":"), "{text}");
        assert!(text.contains("chunk 1 exploded") && text.ends_with("data: [DONE]\n\n"), "{text}");
    }
}
