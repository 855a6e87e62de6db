//! The fuzz harness on inputs that reach deep: a whole session (handshake, structured
//! replies, contexts, writes, reads, block status, disconnect), the same cut at every
//! length, and bytes flipped in it. None may panic or hang.

use qimg_serve::nbd::proto::*;

fn opt(m: &mut Vec<u8>, o: u32, data: &[u8]) {
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&o.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
}

fn req(m: &mut Vec<u8>, ext: bool, kind: u16, flags: u16, offset: u64, len: u32, data: &[u8]) {
    let magic = if ext {
        EXTENDED_REQUEST_MAGIC
    } else {
        REQUEST_MAGIC
    };
    m.extend_from_slice(&magic.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&1u64.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    if ext {
        m.extend_from_slice(&u64::from(len).to_be_bytes());
    } else {
        m.extend_from_slice(&len.to_be_bytes());
    }
    m.extend_from_slice(data);
}

fn session(extended: bool) -> Vec<u8> {
    let mut m = vec![0b101];
    m.extend_from_slice(&3u32.to_be_bytes());
    let style = if extended {
        OPT_EXTENDED_HEADERS
    } else {
        OPT_STRUCTURED_REPLY
    };
    opt(&mut m, style, &[]);
    let mut q = 0u32.to_be_bytes().to_vec();
    q.extend_from_slice(&2u32.to_be_bytes());
    for c in [CTX_BASE_ALLOCATION, CTX_ALLOCATION_DEPTH] {
        q.extend_from_slice(&(c.len() as u32).to_be_bytes());
        q.extend_from_slice(c.as_bytes());
    }
    opt(&mut m, OPT_SET_META_CONTEXT, &q);
    opt(&mut m, OPT_GO, &[0, 0, 0, 0, 0, 0]);
    req(
        &mut m,
        extended,
        CMD_WRITE,
        CMD_FLAG_FUA,
        4096,
        8,
        b"abcdefgh",
    );
    req(&mut m, extended, CMD_WRITE_ZEROES, 0, 65536, 4096, &[]);
    req(&mut m, extended, CMD_READ, 0, 0, 65536 * 2, &[]);
    req(&mut m, extended, CMD_BLOCK_STATUS, 0, 0, 1 << 20, &[]);
    req(&mut m, extended, CMD_TRIM, 0, 0, 65536, &[]);
    req(&mut m, extended, CMD_FLUSH, 0, 0, 0, &[]);
    req(&mut m, extended, CMD_DISC, 0, 0, 0, &[]);
    m
}

#[test]
fn a_whole_session_its_prefixes_and_flipped_bytes_run_without_panicking() {
    for extended in [false, true] {
        run_variants(&session(extended));
    }
}

fn run_variants(s: &[u8]) {
    qimg_serve::fuzzing::connection(s);
    for n in (0..s.len()).step_by(7) {
        qimg_serve::fuzzing::connection(&s[..n]);
    }
    for i in (1..s.len()).step_by(5) {
        let mut t = s.to_vec();
        t[i] ^= 0x5a;
        qimg_serve::fuzzing::connection(&t);
    }
}

/// The vhost-user-blk request harness on a well-formed read, write and write-zeroes, every
/// cut of them, and seeded random bytes.
#[test]
fn the_vhost_request_harness_takes_any_bytes() {
    fn desc(v: &mut Vec<u8>, addr: u32, len: u32, write: bool) {
        v.extend_from_slice(&addr.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.push(u8::from(write));
    }
    let mut inputs = Vec::new();
    for (kind, descs) in [
        (
            0u32,
            vec![(0u32, 16u32, false), (4096, 4096, true), (8192, 1, true)],
        ),
        (
            1,
            vec![(0, 16, false), (4096, 4096, false), (8192, 1, true)],
        ),
        (13, vec![(0, 16, false), (16, 16, false), (8192, 1, true)]),
    ] {
        let mut v = vec![0u8, descs.len() as u8];
        for (a, l, w) in descs {
            desc(&mut v, a, l, w);
        }
        let mut mem = vec![0u8; 32];
        mem[0..4].copy_from_slice(&kind.to_le_bytes());
        mem[8..16].copy_from_slice(&8u64.to_le_bytes());
        mem[16..24].copy_from_slice(&16u64.to_le_bytes());
        mem[24..28].copy_from_slice(&8u32.to_le_bytes());
        mem[28..32].copy_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&mem);
        inputs.push(v);
    }
    for input in &inputs {
        for cut in 0..=input.len() {
            qimg_serve::fuzzing::vhost_request(&input[..cut]);
        }
        for flags in 0..4u8 {
            let mut v = input.clone();
            v[0] = flags;
            qimg_serve::fuzzing::vhost_request(&v);
        }
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..2000 {
        let n = (x % 200) as usize;
        let v: Vec<u8> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        qimg_serve::fuzzing::vhost_request(&v);
    }
}

/// The committed `vhost_request` corpus (found by cargo-fuzz) replays through the harness.
#[test]
fn the_vhost_request_corpus_replays() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/vhost_request");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus directory") {
        let path = entry.unwrap().path();
        qimg_serve::fuzzing::vhost_request(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 50, "{n} inputs in {}", dir.display());
}

/// The `nbd` target's seeds are the two sessions above (structured replies, extended
/// headers), written by this test: without them libFuzzer spends its runs on the handshake's
/// magic numbers (a 30-minute run without seeds kept 9 inputs). `QIMG_UPDATE_CORPUS=1`
/// rewrites them; otherwise they must match what `session` builds. Every committed input
/// replays through the harness.
#[test]
fn the_nbd_seeds_are_the_sessions_and_the_corpus_replays() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/nbd");
    for (name, extended) in [("session-structured", false), ("session-extended", true)] {
        let want = session(extended);
        let path = dir.join(name);
        if std::env::var_os("QIMG_UPDATE_CORPUS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &want).unwrap();
        }
        let got = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            got == want,
            "{} is not what session() builds",
            path.display()
        );
    }
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus directory") {
        qimg_serve::fuzzing::connection(&std::fs::read(entry.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n >= 2, "{n} inputs in {}", dir.display());
}

/// Inputs the `nbd` target found that took long: each now ends at once.
/// `payload-cut-short-waited-for-the-drain-timeout`: an extended-headers READ flagged as
/// carrying a payload whose bytes never all came; the request, counted in flight, kept the
/// connection draining until its 10-second timeout (the fuzz binary took 20 s on it).
#[test]
fn the_nbd_regressions_end_at_once() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/nbd");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("the regressions directory") {
        let path = entry.unwrap().path();
        let start = std::time::Instant::now();
        qimg_serve::fuzzing::connection(&std::fs::read(&path).unwrap());
        let took = start.elapsed();
        // The drain timeout is 10 s; a connection that ends on its own takes milliseconds.
        assert!(took.as_secs() < 5, "{} took {took:?}", path.display());
        n += 1;
    }
    assert!(n >= 1, "{n} inputs in {}", dir.display());
}
