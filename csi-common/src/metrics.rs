//! Prometheus plumbing node and controller share: CSI calls by method and gRPC code with
//! their latency, and `/metrics` served as OpenMetrics text. Labels never carry a volume id:
//! per-volume series grow without bound, and `status` answers per-volume questions.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub type Labels = Vec<(&'static str, String)>;

/// CSI calls by method and code, and their latency by method.
#[derive(Debug)]
pub struct CallMetrics {
    requests: Family<Labels, Counter>,
    durations: Family<Labels, Histogram, fn() -> Histogram>,
}

fn buckets() -> Histogram {
    // 5 ms to ~80 s: from an idempotent repeat to a large mkfs or copy.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

impl CallMetrics {
    /// Registers `requests` and `request_duration_seconds` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let requests = Family::<Labels, Counter>::default();
        let durations =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(buckets);
        registry.register(
            "requests",
            "CSI calls by method and gRPC code",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "CSI call latency by method",
            durations.clone(),
        );
        Self {
            requests,
            durations,
        }
    }

    pub fn observe(&self, method: &'static str, code: tonic::Code, seconds: f64) {
        self.requests
            .get_or_create(&vec![
                ("method", method.to_owned()),
                ("code", format!("{code:?}")),
            ])
            .inc();
        self.durations
            .get_or_create(&vec![("method", method.to_owned())])
            .observe(seconds);
    }
}

/// The registry as OpenMetrics text.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// Serves `render()` as `/metrics` on `listener` until the process ends.
pub async fn serve<F>(render: F, listener: tokio::net::TcpListener) -> std::io::Result<()>
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    render(),
                )
            }
        }),
    );
    axum::serve(listener, app).await
}
