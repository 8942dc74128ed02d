//! OpenTelemetry export (cargo feature `otlp`, off by default): the spans Keel already logs
//! (`request`, `execution`, `step`, `provider_request`, `tool`, with their session,
//! execution and call ids as attributes) also sent to a collector over OTLP/HTTP.
//!
//! Spans are batched and sent from a background thread, so a slow or absent collector
//! costs the agent loop nothing but memory for the batch queue (bounded by the SDK, which
//! drops spans past it). The standard `OTEL_EXPORTER_OTLP_HEADERS` and
//! `OTEL_EXPORTER_OTLP_TIMEOUT` variables are honoured for what Keel does not set itself.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::registry::LookupSpan;

/// How spans are encoded for the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Protocol {
    /// `http/protobuf`, what collectors expect by default.
    #[default]
    Protobuf,
    /// `http/json`.
    Json,
}

/// A running export; [`Export::shutdown`] sends what is still buffered.
#[derive(Debug)]
pub struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// Starts exporting to the collector whose base URL is `endpoint` (for example
    /// `http://127.0.0.1:4318`); spans go to `{endpoint}/v1/traces`. Must be called
    /// outside an async runtime: the exporter's HTTP client runs on its own thread.
    pub fn start(endpoint: &str, protocol: Protocol) -> Result<Self, String> {
        let base = endpoint.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "the OTLP endpoint `{endpoint}` is not an http:// or https:// URL"
            ));
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!("{base}/v1/traces"))
            .with_protocol(match protocol {
                Protocol::Protobuf => opentelemetry_otlp::Protocol::HttpBinary,
                Protocol::Json => opentelemetry_otlp::Protocol::HttpJson,
            })
            .build()
            .map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
        let resource = Resource::builder_empty()
            .with_service_name("keel")
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        Ok(Self { provider })
    }

    /// The `tracing` layer that turns Keel's spans into OpenTelemetry spans.
    pub fn layer<S>(&self) -> OpenTelemetryLayer<S, SdkTracer>
    where
        S: Subscriber + for<'span> LookupSpan<'span>,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("keel"))
    }

    /// Sends the spans still buffered and stops the export (waiting for the collector up
    /// to the exporter's timeout). Call it outside an async runtime, once the work is done.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "the OTLP export did not shut down cleanly");
        }
    }
}
