//! The NBD client's multi-conn: a second connection when a request finds the first busy and
//! the server offers `NBD_FLAG_CAN_MULTI_CONN` (qemu-nbd `-e 4`, `qimg serve --shared 4`),
//! never one when it does not (qemu-nbd's and `qimg serve`'s default, one client at a time).
//! A proxy in front of the server's socket counts the connections the client makes; for the
//! positive case it holds the first reply on the first connection until a second connection
//! arrives, so that the second request is sure to find the first connection busy.

use crate::common;
use crate::nbd_interop::{Server, create, have_qemu_tools, qemu_nbd, qimg_serve, uri};

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use qimg::io::Storage;
use qimg::io::nbd::NbdStorage;

/// How long the gate holds the first reply when no second connection comes: a hang guard,
/// well over ten times the quiet time (opening a second connection takes milliseconds here;
/// 60 s is thousands of times that, also on a busy machine).
const GATE_GUARD: Duration = Duration::from_secs(60);

/// The simple and structured reply magics: a server's chunk that starts with one is a reply
/// to a request (the handshake's replies carry another magic).
const REPLY_MAGICS: [[u8; 4]; 2] = [0x6744_6698u32.to_be_bytes(), 0x668e_33efu32.to_be_bytes()];

/// Connections accepted so far, and a wakeup when one is.
type Count = Arc<(Mutex<usize>, Condvar)>;

/// A Unix socket proxy in front of `upstream` that counts the connections made to it.
struct Proxy {
    count: Count,
    socket: std::path::PathBuf,
}

impl Proxy {
    /// Listens on `socket`, relaying each connection to `upstream`; with `gate`, the first
    /// connection's first reply waits until a second connection is accepted (or
    /// [`GATE_GUARD`] passes).
    fn start(upstream: &Path, socket: &Path, gate: bool) -> Proxy {
        let listener = UnixListener::bind(socket).unwrap();
        let count: Count = Arc::new((Mutex::new(0), Condvar::new()));
        let upstream = upstream.to_path_buf();
        let c = count.clone();
        // The accept loop ends with the test process.
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let n = {
                    let mut n = c.0.lock().unwrap();
                    *n += 1;
                    c.1.notify_all();
                    *n
                };
                let server = UnixStream::connect(&upstream).unwrap();
                relay(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    None,
                );
                relay(server, client, (gate && n == 1).then(|| c.clone()));
            }
        });
        Proxy {
            count,
            socket: socket.to_path_buf(),
        }
    }

    fn connections(&self) -> usize {
        *self.count.0.lock().unwrap()
    }

    fn uri(&self) -> String {
        uri("", &self.socket)
    }
}

/// Copies `from` into `to` on a thread until `from` ends; with `gate`, the first chunk that
/// starts a reply waits until two connections were accepted.
fn relay(mut from: UnixStream, mut to: UnixStream, gate: Option<Count>) {
    std::thread::spawn(move || {
        let mut gate = gate;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if n >= 4 && REPLY_MAGICS.iter().any(|m| buf[..4] == *m) {
                if let Some(c) = gate.take() {
                    // Until the second connection is accepted; the guard only ends a wait
                    // that a client without multi-conn would make forever (the test then
                    // fails on the connection count, not on time).
                    let count = c.0.lock().unwrap();
                    let _ =
                        c.1.wait_timeout_while(count, GATE_GUARD, |n| *n < 2)
                            .unwrap();
                }
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// Makes `a.qcow2` with 0x42 in its first MiB and 0x17 in its second.
fn image(dir: &Path) {
    create(dir, "a.qcow2", true, None);
    common::qemu_io(
        dir,
        "qcow2",
        "a.qcow2",
        &["write -P 0x42 0 1M", "write -P 0x17 1M 1M"],
    );
}

fn read(s: &NbdStorage, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; 1 << 20];
    assert_eq!(s.read_blocking(&mut buf, offset).unwrap(), buf.len());
    buf
}

#[test]
fn the_client_opens_a_second_connection_when_the_server_offers_multi_conn() {
    let test = "the_client_opens_a_second_connection_when_the_server_offers_multi_conn";
    if !have_qemu_tools(test) {
        return;
    }
    for server in ["qemu-nbd", "qimg"] {
        let s = Scratch::new(&format!("nbd-multi-conn-{server}"));
        let dir = &s.0;
        image(dir);
        let sock = s.path("server.sock");
        let srv: Server = match server {
            "qemu-nbd" => qemu_nbd(dir, "a.qcow2", &sock, &["-e", "4"]),
            _ => qimg_serve(dir, "a.qcow2", &sock, &["--shared", "4"]),
        };
        let proxy = Proxy::start(&sock, &s.path("proxy.sock"), true);
        let nbd = NbdStorage::connect(&proxy.uri(), true).unwrap();
        assert!(nbd.can_multi_conn(), "{server} -e 4 offers multi-conn");
        assert_eq!(nbd.connections(), 1, "one connection until one is busy");
        // Two reads together: the first connection's reply waits for a second connection,
        // which the other read must open.
        let (a, b) = std::thread::scope(|t| {
            let a = t.spawn(|| read(&nbd, 0));
            let b = t.spawn(|| read(&nbd, 1 << 20));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(a.iter().all(|&x| x == 0x42), "{server}: first MiB");
        assert!(b.iter().all(|&x| x == 0x17), "{server}: second MiB");
        assert_eq!(proxy.connections(), 2, "{server}: connections made");
        assert_eq!(nbd.connections(), 2, "{server}: connections kept");
        // A write on either connection, flushed on either, is there for both (the server's
        // multi-conn promise), and in the image once the server stops.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            nbd.write_at(&[0x33; 65536], 4 << 20).await.unwrap();
            nbd.flush().await.unwrap();
        });
        std::thread::scope(|t| {
            for _ in 0..2 {
                t.spawn(|| assert!(read(&nbd, 4 << 20)[..65536].iter().all(|&x| x == 0x33)));
            }
        });
        assert!(nbd.connections() <= qimg::io::nbd::MAX_CONNECTIONS);
        drop(nbd);
        srv.stop();
        ok("qemu-img check", &qemu_img(dir, &["check", "a.qcow2"]));
        common::qemu_io(
            dir,
            "qcow2",
            "a.qcow2",
            &[
                "read -P 0x42 0 1M",
                "read -P 0x17 1M 1M",
                "read -P 0x33 4M 64k",
            ],
        );
    }
}

#[test]
fn a_server_without_multi_conn_gets_one_connection_whatever_the_callers() {
    let test = "a_server_without_multi_conn_gets_one_connection_whatever_the_callers";
    if !have_qemu_tools(test) {
        return;
    }
    for server in ["qemu-nbd", "qimg"] {
        let s = Scratch::new(&format!("nbd-single-conn-{server}"));
        let dir = &s.0;
        image(dir);
        let sock = s.path("server.sock");
        let srv = match server {
            "qemu-nbd" => qemu_nbd(dir, "a.qcow2", &sock, &[]),
            _ => qimg_serve(dir, "a.qcow2", &sock, &[]),
        };
        let proxy = Proxy::start(&sock, &s.path("proxy.sock"), false);
        let nbd = NbdStorage::connect(&proxy.uri(), false).unwrap();
        assert!(!nbd.can_multi_conn());
        std::thread::scope(|t| {
            for i in 0..4u64 {
                let nbd = &nbd;
                t.spawn(move || {
                    for j in 0..8u64 {
                        let at = ((i + j) % 2) << 20;
                        let want = if at == 0 { 0x42 } else { 0x17 };
                        assert!(read(nbd, at).iter().all(|&x| x == want));
                    }
                });
            }
        });
        assert_eq!(proxy.connections(), 1, "{server}: connections made");
        assert_eq!(nbd.connections(), 1);
        drop(nbd);
        srv.stop();
    }
}

/// qemu-img convert out of a multi-conn export (its parallel chunks may use several
/// connections) copies the guest data exactly, as QEMU's convert does.
#[test]
fn convert_out_of_a_multi_conn_export_copies_exactly() {
    let test = "convert_out_of_a_multi_conn_export_copies_exactly";
    if !have_qemu_tools(test) {
        return;
    }
    let s = Scratch::new("nbd-multi-conn-convert");
    let dir = &s.0;
    image(dir);
    common::qemu_io(
        dir,
        "qcow2",
        "a.qcow2",
        &[
            "write -P 0x5a 8M 24M",
            "write -z 40M 4M",
            "write -P 1 60M 4M",
        ],
    );
    let sock = s.path("server.sock");
    let srv = qemu_nbd(dir, "a.qcow2", &sock, &["-e", "4", "-r"]);
    let proxy = Proxy::start(&sock, &s.path("proxy.sock"), false);
    ok(
        "qimg convert",
        &qimg(
            dir,
            &["convert", "-f", "raw", "-O", "raw", &proxy.uri(), "out.raw"],
        ),
    );
    eprintln!("convert used {} connection(s)", proxy.connections());
    assert!((1..=qimg::io::nbd::MAX_CONNECTIONS).contains(&proxy.connections()));
    srv.stop();
    ok(
        "qemu-img compare",
        &qemu_img(
            dir,
            &["compare", "-f", "qcow2", "-F", "raw", "a.qcow2", "out.raw"],
        ),
    );
}
