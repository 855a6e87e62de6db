//! TLS for the NBD client (`NBD_OPT_STARTTLS`), with rustls: the credentials directory as
//! QEMU's `tls-creds-x509` (endpoint `client`) and libnbd's `tls-certificates` lay it out
//! (`ca-cert.pem`; `client-cert.pem` and `client-key.pem` when the server asks for a client
//! certificate). The server's certificate must chain to `ca-cert.pem`; its name is checked
//! against [`NbdTls::hostname`](super::NbdTls) or the TCP host, and not for a Unix socket
//! without `tls-hostname`, as QEMU does.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::address::NbdTls;
use super::stream::Stream;

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

fn certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!("{}: no certificate in the file", path.display())));
    }
    Ok(certs)
}

/// The WebPKI verifier, with the name check left out when there is no name to check.
#[derive(Debug)]
struct Verifier {
    inner: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Runs the TLS handshake as a client over `stream` (after the server acknowledged
/// `NBD_OPT_STARTTLS`); `host` is the TCP host, if any.
pub(super) fn start(stream: Stream, tls: &NbdTls, host: Option<&str>) -> io::Result<Stream> {
    let dir = &tls.certificates;
    let mut roots = RootCertStore::empty();
    for ca in certs(&dir.join("ca-cert.pem"))? {
        roots
            .add(ca)
            .map_err(|e| invalid(format!("{}: {e}", dir.join("ca-cert.pem").display())))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| invalid(format!("TLS credentials in {}: {e}", dir.display())))?;
    let name = tls.hostname.as_deref().or(host);
    let verifier = Arc::new(Verifier {
        inner,
        check_name: name.is_some(),
    });
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    let config = if cert.exists() && key.exists() {
        let k = PrivateKeyDer::from_pem_file(&key)
            .map_err(|e| invalid(format!("{}: {e}", key.display())))?;
        builder
            .with_client_auth_cert(certs(&cert)?, k)
            .map_err(|e| invalid(format!("TLS credentials in {}: {e}", dir.display())))?
    } else {
        builder.with_no_client_auth()
    };
    // Without a name to check, any syntactically valid one does (the check is skipped).
    let server_name = ServerName::try_from(name.unwrap_or("localhost").to_string())
        .map_err(|e| invalid(format!("TLS host name: {e}")))?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), server_name)
        .map_err(|e| invalid(e.to_string()))?;
    let mut sock = stream;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).map_err(|e| {
            io::Error::new(e.kind(), format!("TLS handshake failed: {e}"))
        })?;
    }
    Ok(Stream::Tls(Box::new(rustls::StreamOwned::new(conn, sock))))
}
