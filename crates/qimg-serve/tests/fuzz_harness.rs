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
