//! https: one rustls configuration per [`Client`](crate::Client), used by both its REST
//! requests (reqwest) and its log streams (hyper-rustls), so both trust the same roots.
//!
//! The roots are the system's (`rustls-native-certs`: the platform's store, or the files
//! `SSL_CERT_FILE` / `SSL_CERT_DIR` name), plus any CA certificate the caller adds, for a
//! server whose certificate a private CA signed.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

use crate::Error;

/// A client TLS configuration trusting the system's roots and `extra` (PEM certificates).
pub(crate) fn config(
    extra: &[CertificateDer<'static>],
) -> Result<Arc<rustls::ClientConfig>, Error> {
    let mut roots = RootCertStore::empty();
    // Certificates the system store holds but rustls cannot parse are skipped, as are
    // stores that cannot be read: a private CA may be all that is needed.
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    for cert in extra {
        roots
            .add(cert.clone())
            .map_err(|e| Error::Tls(format!("the CA certificate is not usable: {e}")))?;
    }
    if roots.is_empty() {
        return Err(Error::Tls(
            "no trusted certificate: the system has none and no CA certificate was given".into(),
        ));
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(format!("no usable TLS version: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The certificates in `pem` (one or several `CERTIFICATE` blocks).
pub(crate) fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Tls(format!("the CA certificate is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::Tls(
            "the CA file holds no `BEGIN CERTIFICATE` block".into(),
        ));
    }
    Ok(certs)
}
