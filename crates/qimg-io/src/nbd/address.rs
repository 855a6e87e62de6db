//! NBD image names as QEMU and libnbd write them, and back.

use std::path::PathBuf;

/// The default port.
const PORT: u16 = 10809;

/// Where an NBD export is: its server and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdAddress {
    /// The server.
    pub server: NbdServer,
    /// The export name ("" for the default export).
    pub export: String,
    /// TLS (`NBD_OPT_STARTTLS` before anything else), when the name asks for it.
    pub tls: Option<NbdTls>,
}

/// TLS for an NBD connection: what QEMU's `tls-creds-x509` object (endpoint `client`) and
/// `tls-hostname` option say, or libnbd's `nbds://...?tls-certificates=DIR` URIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTls {
    /// The credentials directory: `ca-cert.pem` (the CAs a server certificate must chain
    /// to), and `client-cert.pem` / `client-key.pem` when the server wants a client
    /// certificate.
    pub certificates: PathBuf,
    /// The name the server's certificate must carry: this, else the host of a TCP address
    /// (a Unix socket needs it, as in QEMU).
    pub hostname: Option<String>,
}

/// An NBD server's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdServer {
    /// TCP: host and port.
    Tcp(String, u16),
    /// A Unix socket path.
    Unix(String),
}

impl NbdAddress {
    /// Parses an image name as QEMU does: `None` when it names no NBD export (a file name);
    /// an error for an NBD name qimg cannot use (a malformed URI). Beyond QEMU, libnbd's TLS
    /// URIs (`nbds://`, `nbds+unix://`, with `tls-certificates=DIR` and optionally
    /// `tls-hostname=NAME`) are taken too.
    pub fn parse(name: &str) -> std::result::Result<Option<Self>, String> {
        let uri = |rest: &str, unix: bool, tls: bool| -> std::result::Result<Self, String> {
            let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
            let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
            let export = percent_decode(path);
            let mut socket = None;
            let (mut certificates, mut hostname) = (None, None);
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                match pair.split_once('=') {
                    Some(("socket", s)) => socket = Some(percent_decode(s)),
                    Some(("tls-certificates", d)) if tls => {
                        certificates = Some(PathBuf::from(percent_decode(d)))
                    }
                    Some(("tls-hostname", h)) if tls => hostname = Some(percent_decode(h)),
                    _ => return Err(format!("unexpected query parameter '{pair}' in '{name}'")),
                }
            }
            let tls = match (tls, certificates) {
                (false, _) => None,
                (true, Some(certificates)) => Some(NbdTls {
                    certificates,
                    hostname,
                }),
                (true, None) => {
                    return Err(format!(
                        "'{name}': an nbds URI needs tls-certificates=DIR (the directory of \
                         ca-cert.pem, client-cert.pem and client-key.pem)"
                    ));
                }
            };
            let server = if unix {
                if !authority.is_empty() {
                    return Err(format!("'{name}': an nbd+unix URI takes no host"));
                }
                NbdServer::Unix(socket.ok_or_else(|| format!("'{name}': missing socket"))?)
            } else {
                if socket.is_some() {
                    return Err(format!("'{name}': socket= is only for nbd+unix URIs"));
                }
                let (host, port) = split_host_port(authority)?;
                NbdServer::Tcp(
                    if host.is_empty() {
                        "localhost".into()
                    } else {
                        host
                    },
                    port,
                )
            };
            Ok(NbdAddress {
                server,
                export,
                tls,
            })
        };
        for (scheme, unix, tls) in [
            ("nbd://", false, false),
            ("nbd+tcp://", false, false),
            ("nbd+unix://", true, false),
            ("nbds://", false, true),
            ("nbds+tcp://", false, true),
            ("nbds+unix://", true, true),
        ] {
            if let Some(rest) = name.strip_prefix(scheme) {
                return uri(rest, unix, tls).map(Some);
            }
        }
        let Some(rest) = name.strip_prefix("nbd:") else {
            return Ok(None);
        };
        // Legacy: nbd:unix:PATH[:exportname=NAME] or nbd:HOST:PORT[:exportname=NAME].
        let (main, export) = match rest.split_once(":exportname=") {
            Some((m, e)) => (m, e.to_string()),
            None => (rest, String::new()),
        };
        let server = match main.strip_prefix("unix:") {
            Some(path) => NbdServer::Unix(path.to_string()),
            None => {
                let (host, port) = main
                    .rsplit_once(':')
                    .ok_or_else(|| format!("'{name}': expected nbd:HOST:PORT"))?;
                let port = port
                    .parse()
                    .map_err(|_| format!("'{name}': bad port '{port}'"))?;
                NbdServer::Tcp(host.to_string(), port)
            }
        };
        Ok(Some(NbdAddress {
            server,
            export,
            tls: None,
        }))
    }
}

impl std::fmt::Display for NbdAddress {
    /// The name as QEMU writes it back (what `qemu-img info` shows): the URI form, the
    /// default port left out, no export part for the default export.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let export = if self.export.is_empty() {
            String::new()
        } else {
            format!("/{}", self.export)
        };
        let s = if self.tls.is_some() { "s" } else { "" };
        match &self.server {
            NbdServer::Unix(path) => write!(f, "nbd{s}+unix://{export}?socket={path}"),
            NbdServer::Tcp(host, port) => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                match *port {
                    PORT => write!(f, "nbd{s}://{host}{export}"),
                    p => write!(f, "nbd{s}://{host}:{p}{export}"),
                }
            }
        }
    }
}

/// Whether `name` names an NBD export (see [`NbdAddress::parse`]) rather than a file: the
/// one test every open by name makes.
pub fn is_nbd_name(name: &str) -> bool {
    name.starts_with("nbd") && NbdAddress::parse(name) != Ok(None)
}

fn split_host_port(authority: &str) -> std::result::Result<(String, u16), String> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("unterminated [ in host")?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| format!("bad port '{p}'"))?,
            None => PORT,
        };
        return Ok((host.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Ok((
            h.to_string(),
            p.parse().map_err(|_| format!("bad port '{p}'"))?,
        )),
        None => Ok((authority.to_string(), PORT)),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16);
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_as_qemu_parses_them() {
        let p = |s: &str| NbdAddress::parse(s).unwrap().unwrap();
        assert_eq!(
            p("nbd://example.com:1234/disk"),
            NbdAddress {
                server: NbdServer::Tcp("example.com".into(), 1234),
                export: "disk".into(),
                tls: None,
            }
        );
        assert_eq!(
            p("nbd://localhost/").server,
            NbdServer::Tcp("localhost".into(), PORT)
        );
        assert_eq!(
            p("nbd://[::1]:99/x").server,
            NbdServer::Tcp("::1".into(), 99)
        );
        assert_eq!(
            p("nbd+unix:///exp%20a?socket=/tmp/s.sock"),
            NbdAddress {
                server: NbdServer::Unix("/tmp/s.sock".into()),
                export: "exp a".into(),
                tls: None,
            }
        );
        assert_eq!(
            p("nbd:unix:/tmp/s:exportname=e"),
            NbdAddress {
                server: NbdServer::Unix("/tmp/s".into()),
                export: "e".into(),
                tls: None,
            }
        );
        assert_eq!(p("nbd:h:10810").server, NbdServer::Tcp("h".into(), 10810));
        assert_eq!(NbdAddress::parse("disk.qcow2").unwrap(), None);
        assert!(
            NbdAddress::parse("nbds://h/x")
                .unwrap_err()
                .contains("tls-certificates")
        );
        assert_eq!(
            p("nbds+unix:///e?socket=/s&tls-certificates=/c&tls-hostname=h").tls,
            Some(NbdTls {
                certificates: "/c".into(),
                hostname: Some("h".into()),
            })
        );
        assert!(NbdAddress::parse("nbd://h/x?tls-certificates=/c").is_err());
        assert!(NbdAddress::parse("nbd+unix:///x").is_err(), "no socket");
        assert!(NbdAddress::parse("nbd://h:port/x").is_err());
    }

    #[test]
    fn names_are_written_back_as_qemu_writes_them() {
        let show = |s: &str| NbdAddress::parse(s).unwrap().unwrap().to_string();
        assert_eq!(show("nbd+unix:///?socket=/s"), "nbd+unix://?socket=/s");
        assert_eq!(show("nbd+unix:///e?socket=/s"), "nbd+unix:///e?socket=/s");
        assert_eq!(show("nbd://h:10809/e"), "nbd://h/e");
        assert_eq!(show("nbd:h:99"), "nbd://h:99");
        assert_eq!(show("nbd:unix:/s:exportname=e"), "nbd+unix:///e?socket=/s");
        assert_eq!(show("nbds://h:99/e?tls-certificates=/c"), "nbds://h:99/e");
    }
}
