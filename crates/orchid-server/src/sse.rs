//! Server-sent events: each JSON chunk as a `data: {json}` event, then `data: [DONE]`.
//! A panic while producing a chunk ends the stream with an error event (the OpenAI envelope)
//! and `[DONE]` instead of tearing the connection down mid-event.

use std::convert::Infallible;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::Value;

use crate::errors::ApiError;

/// A streaming response from a stream of JSON chunks. Dropping the response body (the client
/// went away) drops `chunks`.
pub fn sse_response(chunks: impl Stream<Item = Value> + Send + 'static) -> Response {
    let body = Body::from_stream(Events {
        inner: Some(Box::pin(chunks)),
        done_sent: false,
    });
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

struct Events {
    inner: Option<Pin<Box<dyn Stream<Item = Value> + Send>>>,
    done_sent: bool,
}

impl Stream for Events {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(inner) = this.inner.as_mut() {
            match catch_unwind(AssertUnwindSafe(|| inner.as_mut().poll_next(cx))) {
                Ok(Poll::Pending) => return Poll::Pending,
                Ok(Poll::Ready(Some(v))) => return Poll::Ready(Some(Ok(event(&v)))),
                Ok(Poll::Ready(None)) => this.inner = None,
                Err(panic) => {
                    this.inner = None;
                    let err = ApiError::from_panic(panic.as_ref());
                    return Poll::Ready(Some(Ok(event(&err.to_json()))));
                }
            }
        }
        if this.done_sent {
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
        assert_eq!(
            body_text(resp).await,
            "data: {\"a\":1}\n\ndata: {\"b\":\"x\\ny\"}\n\ndata: [DONE]\n\n"
        );
    }

    #[tokio::test]
    async fn panic_becomes_an_error_event() {
        let s = futures::stream::iter(0..3).map(|i| if i == 1 { panic!("chunk {i} exploded") } else { json!(i) });
        let text = body_text(sse_response(s)).await;
        assert!(text.starts_with("data: 0\n\ndata: {\"error\":"), "{text}");
        assert!(text.contains("chunk 1 exploded") && text.ends_with("data: [DONE]\n\n"), "{text}");
    }
}
