//! TLS for the NBD client (`NBD_OPT_STARTTLS`), with rustls: the credentials directory as
//! QEMU's `tls-creds-x509` (endpoint `client`) and libnbd's `tls-certificates` lay it out
//! (`ca-cert.pem`; `client-cert.pem` and `client-key.pem` when the server asks for a client
//! certificate). The server's certificate must chain to `ca-cert.pem` and carry the name
//! [`NbdTls::hostname`](super::NbdTls), else the TCP host; a Unix socket without
//! `tls-hostname` is refused, as QEMU refuses it.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

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
        return Err(invalid(format!(
            "{}: no certificate in the file",
            path.display()
        )));
    }
    Ok(certs)
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
    // As QEMU: the server's certificate is checked against a name, `tls-hostname` or the
    // TCP host; a Unix socket without `tls-hostname` has none and is refused.
    let name = tls
        .hostname
        .as_deref()
        .or(host)
        .ok_or_else(|| invalid("No hostname for certificate validation".into()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(e.to_string()))?
        .with_root_certificates(roots);
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
    let server_name = ServerName::try_from(name.to_string())
        .map_err(|e| invalid(format!("TLS host name: {e}")))?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), server_name)
        .map_err(|e| invalid(e.to_string()))?;
    let mut sock = stream;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock)
            .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake failed: {e}")))?;
    }
    Ok(Stream::Tls(Box::new(rustls::StreamOwned::new(conn, sock))))
}
