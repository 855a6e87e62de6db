//! The connection's byte stream: TCP, a Unix socket, or a TLS session over either.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connection: a TCP or Unix stream, or a TLS session over one.
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    #[cfg(feature = "nbd-tls")]
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, Stream>>),
}

impl Stream {
    pub(super) fn set_read_timeout(&self, t: Option<Duration>) {
        let _ = match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
            #[cfg(feature = "nbd-tls")]
            Stream::Tls(s) => {
                s.sock.set_read_timeout(t);
                Ok(())
            }
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            #[cfg(feature = "nbd-tls")]
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            #[cfg(feature = "nbd-tls")]
            Stream::Tls(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
            #[cfg(feature = "nbd-tls")]
            Stream::Tls(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
            #[cfg(feature = "nbd-tls")]
            Stream::Tls(s) => s.flush(),
        }
    }
}
