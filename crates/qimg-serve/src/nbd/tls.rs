//! TLS for `NBD_OPT_STARTTLS`, with credentials laid out as QEMU's `tls-creds-x509` object
//! (`endpoint=server`, its default `verify-peer=on`): a directory holding `ca-cert.pem`,
//! `server-cert.pem` and `server-key.pem`. Clients must present a certificate signed by that
//! CA. The session is rustls' (ring provider); nothing cryptographic is written here.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use super::{BoxStream, StartTls};

/// How long a client may take to complete the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why credentials could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file is missing or malformed.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls refused the certificates or key.
    #[error("TLS credentials in {dir}: {what}")]
    Config {
        /// The credentials directory.
        dir: PathBuf,
        /// rustls' reason.
        what: String,
    },
}

/// Server credentials: accepts TLS sessions on client streams.
#[derive(Clone)]
pub struct TlsCreds {
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for TlsCreds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsCreds")
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |what: String| TlsError::Pem {
        path: path.to_path_buf(),
        what,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no certificate in the file".into()));
    }
    Ok(certs)
}

impl TlsCreds {
    /// Loads `ca-cert.pem`, `server-cert.pem` and `server-key.pem` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TlsError> {
        let config = |what: String| TlsError::Config {
            dir: dir.to_path_buf(),
            what,
        };
        let mut roots = RootCertStore::empty();
        for ca in certs(&dir.join("ca-cert.pem"))? {
            roots
                .add(ca)
                .map_err(|e| config(format!("ca-cert.pem: {e}")))?;
        }
        let chain = certs(&dir.join("server-cert.pem"))?;
        let key_path = dir.join("server-key.pem");
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TlsError::Pem {
            path: key_path,
            what: e.to_string(),
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| config(e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| config(e.to_string()))?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
        })
    }
}

impl StartTls for TlsCreds {
    fn accept(
        &self,
        stream: BoxStream,
    ) -> Pin<Box<dyn Future<Output = io::Result<BoxStream>> + Send>> {
        let acceptor = self.acceptor.clone();
        Box::pin(async move {
            let session = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                .await
                .map_err(|_| {
                    io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out")
                })??;
            Ok(Box::new(session) as BoxStream)
        })
    }
}
