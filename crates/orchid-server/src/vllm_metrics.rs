//! vLLM's metric names, so that dashboards and autoscalers written for vLLM work unchanged.
//! Every sample has a `model_name` label (the served model id). They are views of the same
//! counters as orchid's own metrics:
//!
//! | metric | kind | same as |
//! |---|---|---|
//! | `vllm:num_requests_running` | gauge | `orchid_running_sequences` |
//! | `vllm:num_requests_waiting` | gauge | `orchid_queue_depth` |
//! | `vllm:kv_cache_usage_perc` | gauge | sequence slots in use / slots (0..1; state is per slot) |
//! | `vllm:prompt_tokens_total` | counter | `orchid_prompt_tokens_total` |
//! | `vllm:generation_tokens_total` | counter | `orchid_generation_tokens_total` |
//! | `vllm:request_success_total{finished_reason}` | counter | `orchid_request_finish_total` (stop, length, tool_calls) |
//! | `vllm:time_to_first_token_seconds` | histogram | `orchid_time_to_first_token_seconds` |
//! | `vllm:inter_token_latency_seconds` | histogram | `orchid_inter_token_latency_seconds` |
//! | `vllm:time_per_output_token_seconds` | histogram | `orchid_inter_token_latency_seconds` |
//! | `vllm:e2e_request_latency_seconds` | histogram | `orchid_request_duration_seconds` |

use std::fmt::Write;
use std::sync::atomic::Ordering;

use orchid_engine::engine::EngineStats;

use crate::metrics::{Metrics, escape};

/// The vLLM-named samples, appended to orchid's exposition text.
pub fn render(m: &Metrics, stats: &EngineStats, max_seqs: usize, model: &str, out: &mut String) {
    let label = format!("model_name=\"{}\"", escape(model));
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
    let running = load(&stats.running);
    let gauges = [
        ("vllm:num_requests_running", "Number of requests in model execution batches.", running as f64),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load(&stats.queued) as f64),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", running as f64 / max_seqs.max(1) as f64),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{label}}} {v}");
    }
    let counters = [
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", load(&stats.prompt_tokens)),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.", load(&stats.generated_tokens)),
    ];
    for (name, help, v) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{label}}} {v}");
    }
    let name = "vllm:request_success_total";
    let _ = writeln!(out, "# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter");
    for (reason, n) in m.finishes() {
        if matches!(reason, "stop" | "length" | "tool_calls") {
            let _ = writeln!(out, "{name}{{{label},finished_reason=\"{reason}\"}} {n}");
        }
    }
    let hist = [
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &m.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &m.itl),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", &m.itl),
        ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", &m.duration),
    ];
    for (name, help, h) in hist {
        h.render_labeled(out, name, help, &label);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn names_and_labels() {
        let m = Metrics::default();
        m.ttft.observe(Duration::from_millis(30));
        m.record_finish("stop");
        let stats = EngineStats::default();
        stats.running.store(4, Ordering::Relaxed);
        let mut out = String::new();
        render(&m, &stats, 16, "tiny", &mut out);
        assert!(out.contains("vllm:num_requests_running{model_name=\"tiny\"} 4\n"), "{out}");
        assert!(out.contains("vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.25\n"));
        assert!(out.contains("vllm:request_success_total{model_name=\"tiny\",finished_reason=\"stop\"} 1\n"));
        assert!(out.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.05\"} 1\n"));
        assert!(out.contains("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 1\n"));
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.rsplit(' ').next().unwrap().parse::<f64>().is_ok(), "{line}");
        }
    }
}
