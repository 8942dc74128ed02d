//! HTTPS served by Keel itself (`keel serve --tls-cert FILE --tls-key FILE`), with rustls.
//!
//! Handshakes run in their own tasks, off the accept loop, each bounded by
//! [`HANDSHAKE_TIMEOUT`]: a client that connects and never finishes its handshake holds
//! one task for that long, never the listener. A connection whose handshake fails is
//! closed and logged at debug level (scanners do this all day).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a client gets to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections handshaken but not yet taken by the server; past this, handshakes wait.
const READY_QUEUE: usize = 64;

/// The server's TLS configuration from a PEM certificate chain (the server's certificate
/// first) and a PEM private key (PKCS#8, PKCS#1 or SEC1). HTTP/1.1 only, like the rest of
/// Keel's server.
pub fn load(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let read = |path: &Path, what: &str| {
        std::fs::read(path)
            .map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_slice_iter(&read(cert, "certificate")?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the TLS certificate {} is not PEM: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "the TLS certificate {} holds no `BEGIN CERTIFICATE` block",
            cert.display()
        ));
    }
    let key_der = PrivateKeyDer::from_pem_slice(&read(key, "key")?).map_err(|e| {
        format!(
            "the TLS key {} is not a PEM private key: {e}",
            key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("no usable TLS version: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| format!("the TLS certificate and key do not make a usable pair: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener handing the server TLS connections whose handshake is complete.
pub struct Listener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Accepts on `tcp` and handshakes with `config`, until the listener is dropped.
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (sender, ready) = mpsc::channel(READY_QUEUE);
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, say: back off instead of spinning.
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (acceptor, sender) = (acceptor.clone(), sender.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => drop(sender.send((tls, peer)).await),
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            accepting,
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for Listener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
