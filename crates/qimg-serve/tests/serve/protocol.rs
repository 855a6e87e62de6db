//! The server against a well-behaved client built by hand: handshake options, reads with
//! holes, writes, zeroes, trims, block status through a backing chain.

use crate::common;

use common::*;
use qimg_serve::nbd::proto::*;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_reads_send_holes_and_data_and_writes_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", 4 * MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    let flags = c.go("", true, &["base:allocation"]).await;
    let want = TF_HAS_FLAGS
        | TF_SEND_FLUSH
        | TF_SEND_FUA
        | TF_SEND_TRIM
        | TF_SEND_WRITE_ZEROES
        | TF_SEND_DF
        | TF_SEND_CACHE
        | TF_SEND_FAST_ZERO;
    assert_eq!(flags, want);

    let data = vec![0xa5u8; 8192];
    assert_eq!(
        c.call(CMD_WRITE, CMD_FLAG_FUA, 65536, 8192, &data)
            .await
            .error,
        0
    );
    let r = c.call(CMD_READ, 0, 0, 3 * 65536, &[]).await;
    assert_eq!(r.error, 0);
    assert_eq!(&r.data[65536..65536 + 8192], &data[..]);
    assert!(r.data[..65536].iter().all(|&b| b == 0));
    // Unallocated, data, unallocated (subclusters of 2 KiB: 8 KiB is 4 whole subclusters).
    assert_eq!(
        r.chunks,
        [
            REPLY_TYPE_OFFSET_HOLE,
            REPLY_TYPE_OFFSET_DATA,
            REPLY_TYPE_OFFSET_HOLE
        ]
    );
    // With DF the whole read is one data chunk.
    let r = c.call(CMD_READ, CMD_FLAG_DF, 0, 3 * 65536, &[]).await;
    assert_eq!(r.chunks, [REPLY_TYPE_OFFSET_DATA]);
    assert_eq!(&r.data[65536..65536 + 8192], &data[..]);

    let r = c.call(CMD_BLOCK_STATUS, 0, 0, 4 * MIB as u32, &[]).await;
    assert_eq!(r.error, 0);
    let hz = STATE_HOLE | STATE_ZERO;
    let total = 4 * MIB as u32;
    assert_eq!(
        r.status,
        [(
            CTX_ID_BASE,
            vec![(65536, hz), (8192, 0), (total - 65536 - 8192, hz)]
        )]
    );
    let r = c
        .call(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, total, &[])
        .await;
    assert_eq!(r.status, [(CTX_ID_BASE, vec![(65536, hz)])]);

    // Write-zeroes (may punch), then the same with NO_HOLE (stays data), trim.
    assert_eq!(c.call(CMD_WRITE_ZEROES, 0, 65536, 4096, &[]).await.error, 0);
    let r = c.call(CMD_READ, 0, 65536, 8192, &[]).await;
    assert!(r.data[..4096].iter().all(|&b| b == 0));
    assert_eq!(&r.data[4096..], &data[4096..]);
    assert_eq!(
        c.call(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 2 * MIB, 4096, &[])
            .await
            .error,
        0
    );
    let r = c.call(CMD_BLOCK_STATUS, 0, 2 * MIB, 4096, &[]).await;
    assert_eq!(r.status, [(CTX_ID_BASE, vec![(4096, 0)])]);
    // FAST_ZERO: fast without NO_HOLE, refused with it.
    let fast = CMD_FLAG_FAST_ZERO;
    assert_eq!(c.call(CMD_WRITE_ZEROES, fast, 0, 4096, &[]).await.error, 0);
    let both = CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE;
    assert_eq!(
        c.call(CMD_WRITE_ZEROES, both, 0, 4096, &[]).await.error,
        ENOTSUP
    );
    assert_eq!(c.call(CMD_TRIM, 0, 2 * MIB, 65536, &[]).await.error, 0);
    let r = c.call(CMD_BLOCK_STATUS, 0, 2 * MIB, 65536, &[]).await;
    assert_eq!(r.status, [(CTX_ID_BASE, vec![(65536, hz)])]);
    assert_eq!(c.call(CMD_CACHE, 0, 0, 65536, &[]).await.error, 0);
    assert_eq!(c.call(CMD_FLUSH, 0, 0, 0, &[]).await.error, 0);
    c.disconnect().await;
    export.image.close().await.unwrap();
    assert_clean(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_replies_without_structured_and_no_block_status() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, false);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    let flags = c.go("", false, &[]).await;
    assert_eq!(flags & TF_SEND_DF, 0, "DF needs structured replies");
    let data = vec![7u8; 1000];
    assert_eq!(c.call(CMD_WRITE, 0, 12345, 1000, &data).await.error, 0);
    let r = c.call(CMD_READ, 0, 12345, 1000, &[]).await;
    assert_eq!((r.error, &r.data[..], r.chunks.len()), (0, &data[..], 0));
    // No context selected (and none can be without structured replies).
    assert_eq!(
        c.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await.error,
        EINVAL
    );
    // DF is not valid without structured replies.
    assert_eq!(
        c.call(CMD_READ, CMD_FLAG_DF, 0, 4096, &[]).await.error,
        EINVAL
    );
    c.disconnect().await;
    export.image.close().await.unwrap();
    assert_clean(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_depth_follows_the_backing_chain() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_image(dir.path(), "base.qcow2", MIB, false);
    {
        let b = qimg::OpenOptions::new()
            .writable(true)
            .open(&base)
            .await
            .unwrap();
        b.write(&[1u8; 65536], 0).await.unwrap();
        b.close().await.unwrap();
    }
    let top = dir.path().join("top.qcow2");
    let opts = qimg::tools::create::CreateOptions {
        backing_file: Some("base.qcow2".into()),
        backing_fmt: Some("qcow2".into()),
        ..Default::default()
    };
    qimg::tools::create::create(&top, &opts, &mut |_, _| {}).unwrap();
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open(&top)
        .await
        .unwrap();
    img.write(&[2u8; 65536], 2 * 65536).await.unwrap();
    let mut e = qimg_serve::nbd::Export::new(img);
    e.allocation_depth = true;
    e.name = "disk".into();
    let export = std::sync::Arc::new(e);

    // LIST_META_CONTEXT with no query lists both contexts.
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    c.option(OPT_STRUCTURED_REPLY, &[]).await;
    c.option_replies().await;
    let mut q = 4u32.to_be_bytes().to_vec();
    q.extend_from_slice(b"disk");
    q.extend_from_slice(&0u32.to_be_bytes());
    c.option(OPT_LIST_META_CONTEXT, &q).await;
    let r = c.option_replies().await;
    let names: Vec<&[u8]> = r
        .iter()
        .filter(|x| x.0 == REP_META_CONTEXT)
        .map(|x| &x.1[4..])
        .collect();
    assert_eq!(
        names,
        [
            CTX_BASE_ALLOCATION.as_bytes(),
            CTX_ALLOCATION_DEPTH.as_bytes()
        ]
    );
    drop(c);

    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("disk", true, &[CTX_BASE_ALLOCATION, CTX_ALLOCATION_DEPTH])
        .await;
    let r = c.call(CMD_BLOCK_STATUS, 0, 0, MIB as u32, &[]).await;
    let hz = STATE_HOLE | STATE_ZERO;
    let c64 = 65536;
    assert_eq!(
        r.status,
        [
            (
                CTX_ID_BASE,
                vec![(c64, 0), (c64, hz), (c64, 0), ((MIB as u32) - 3 * c64, hz)]
            ),
            (
                CTX_ID_DEPTH,
                vec![(c64, 2), (c64, 0), (c64, 1), ((MIB as u32) - 3 * c64, 0)]
            ),
        ]
    );
    // Reads of backing data are data chunks, not holes.
    let r = c.call(CMD_READ, 0, 0, 3 * c64, &[]).await;
    assert_eq!(r.data[0], 1);
    assert_eq!(r.data[2 * c64 as usize], 2);
    c.disconnect().await;
    export.image.close().await.unwrap();
    assert_clean(&top);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_info_and_unknown_exports() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let img = qimg::OpenOptions::new().open(&path).await.unwrap();
    let mut e = qimg_serve::nbd::Export::new(img);
    e.name = "n".into();
    e.description = Some("the description".into());
    let export = std::sync::Arc::new(e);
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    c.option(OPT_LIST, &[]).await;
    let r = c.option_replies().await;
    assert_eq!(r[0].0, REP_SERVER);
    assert_eq!(&r[0].1[4..], b"nthe description");
    // INFO for a name that does not exist: ERR_UNKNOWN, and the handshake goes on.
    let mut d = 1u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"x");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(OPT_INFO, &d).await;
    assert_eq!(c.option_replies().await[0].0, REP_ERR_UNKNOWN);
    let mut d = 1u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"n");
    d.extend_from_slice(&2u16.to_be_bytes());
    d.extend_from_slice(&INFO_NAME.to_be_bytes());
    d.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
    c.option(OPT_INFO, &d).await;
    let r = c.option_replies().await;
    let infos: Vec<u16> = r
        .iter()
        .filter(|x| x.0 == REP_INFO)
        .map(|x| u16::from_be_bytes([x.1[0], x.1[1]]))
        .collect();
    assert_eq!(
        infos,
        [INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]
    );
    let bs = &r.iter().find(|x| x.0 == REP_INFO && x.1[1] == 3).unwrap().1;
    assert_eq!(
        &bs[2..],
        [
            1u32.to_be_bytes(),
            65536u32.to_be_bytes(),
            MAX_PAYLOAD.to_be_bytes()
        ]
        .concat()
    );
    // A read-only image makes a read-only export.
    let flags = u16::from_be_bytes(r[0].1[10..12].try_into().unwrap());
    assert_eq!(flags & TF_READ_ONLY, TF_READ_ONLY);
    assert_eq!(
        flags & (TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FUA),
        0
    );
    // Unknown option: ERR_UNSUP; ABORT ends the connection cleanly.
    c.option(99, b"abc").await;
    assert_eq!(c.option_replies().await[0].0, REP_ERR_UNSUP);
    c.option(OPT_ABORT, &[]).await;
    assert_eq!(c.option_replies().await[0].0, REP_ACK);
    c.server.await.unwrap().unwrap();
}

/// Sends an extended request (32-byte header).
async fn ext_request(c: &mut Client, kind: u16, flags: u16, offset: u64, len: u64, data: &[u8]) {
    use tokio::io::AsyncWriteExt;
    let mut m = EXTENDED_REQUEST_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&9u64.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m.extend_from_slice(data);
    c.s.write_all(&m).await.unwrap();
}

/// Reads extended reply chunks up to DONE: (type, payload) of each; checks cookie and offset.
async fn ext_reply(c: &mut Client, offset: u64) -> Vec<(u16, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    loop {
        let mut h = [0u8; 32];
        c.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            EXTENDED_REPLY_MAGIC
        );
        let flags = u16::from_be_bytes([h[4], h[5]]);
        let kind = u16::from_be_bytes([h[6], h[7]]);
        assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), 9);
        assert_eq!(u64::from_be_bytes(h[16..24].try_into().unwrap()), offset);
        let len = u64::from_be_bytes(h[24..32].try_into().unwrap());
        let mut p = vec![0u8; len as usize];
        c.s.read_exact(&mut p).await.unwrap();
        out.push((kind, p));
        if flags & REPLY_FLAG_DONE != 0 {
            return out;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_headers_carry_64_bit_lengths_and_never_simple_replies() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 << 30;
    let path = make_image(dir.path(), "a.qcow2", size, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    c.option(OPT_EXTENDED_HEADERS, &[]).await;
    assert_eq!(c.option_replies().await[0].0, REP_ACK);
    let mut q = 0u32.to_be_bytes().to_vec();
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(&(CTX_BASE_ALLOCATION.len() as u32).to_be_bytes());
    q.extend_from_slice(CTX_BASE_ALLOCATION.as_bytes());
    // Extended headers imply structured replies, so contexts can be set.
    c.option(OPT_SET_META_CONTEXT, &q).await;
    assert_eq!(c.option_replies().await.len(), 2);
    c.option(OPT_GO, &[0, 0, 0, 0, 0, 0]).await;
    assert_eq!(c.option_replies().await.last().unwrap().0, REP_ACK);

    let at = 5 << 30;
    ext_request(
        &mut c,
        CMD_WRITE,
        CMD_FLAG_PAYLOAD_LEN,
        at,
        4096,
        &[3u8; 4096],
    )
    .await;
    assert_eq!(ext_reply(&mut c, at).await, [(REPLY_TYPE_NONE, vec![])]);
    ext_request(&mut c, CMD_READ, 0, at, 8192, &[]).await;
    let r = ext_reply(&mut c, at).await;
    assert_eq!(r[0].0, REPLY_TYPE_OFFSET_DATA);
    assert_eq!(&r[0].1[8..], &[3u8; 4096][..]);
    assert_eq!(r[1].0, REPLY_TYPE_OFFSET_HOLE);
    // Block status over more than 4 GiB: 64-bit descriptors (the server answers at most
    // 1 GiB at once).
    ext_request(&mut c, CMD_BLOCK_STATUS, 0, 0, 6 << 30, &[]).await;
    let r = ext_reply(&mut c, 0).await;
    assert_eq!(r[0].0, REPLY_TYPE_BLOCK_STATUS_EXT);
    let p = &r[0].1;
    assert_eq!(u32::from_be_bytes(p[0..4].try_into().unwrap()), CTX_ID_BASE);
    assert_eq!(u32::from_be_bytes(p[4..8].try_into().unwrap()), 1);
    assert_eq!(u64::from_be_bytes(p[8..16].try_into().unwrap()), 1 << 30);
    assert_eq!(
        u64::from(STATE_HOLE | STATE_ZERO),
        u64::from_be_bytes(p[16..24].try_into().unwrap())
    );
    // A trim of more than 4 GiB in one request, then the data is gone.
    ext_request(&mut c, CMD_TRIM, 0, 0, 6 << 30, &[]).await;
    assert_eq!(ext_reply(&mut c, 0).await, [(REPLY_TYPE_NONE, vec![])]);
    ext_request(&mut c, CMD_READ, 0, at, 4096, &[]).await;
    assert_eq!(ext_reply(&mut c, at).await[0].0, REPLY_TYPE_OFFSET_HOLE);
    // Errors are error chunks, even for commands that answer simply otherwise; a payload on
    // a command that takes none is consumed and refused.
    ext_request(&mut c, CMD_FLUSH, CMD_FLAG_PAYLOAD_LEN, 0, 3, b"xyz").await;
    let r = ext_reply(&mut c, 0).await;
    assert_eq!(r[0].0, REPLY_TYPE_ERROR);
    assert_eq!(u32::from_be_bytes(r[0].1[0..4].try_into().unwrap()), EINVAL);
    ext_request(&mut c, CMD_READ, 0, size, 1, &[]).await;
    assert_eq!(ext_reply(&mut c, size).await[0].0, REPLY_TYPE_ERROR);
    ext_request(&mut c, CMD_FLUSH, 0, 0, 0, &[]).await;
    assert_eq!(ext_reply(&mut c, 0).await, [(REPLY_TYPE_NONE, vec![])]);
    ext_request(&mut c, CMD_DISC, 0, 0, 0, &[]).await;
    c.server.await.unwrap().unwrap();
    export.image.close().await.unwrap();
    assert_clean(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_connection_after_its_requests() {
    use qimg_serve::nbd::{Shutdown, serve_connection};
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let export = export(&path).await;
    let (stop, shutdown) = Shutdown::new();
    let (cs, ss) = tokio::io::duplex(1 << 20);
    let server = tokio::spawn(serve_connection(Box::new(ss), export.clone(), shutdown));
    let mut c = Client {
        s: cs,
        server,
        structured: false,
    };
    c.go("", false, &[]).await;
    assert_eq!(c.call(CMD_WRITE, 0, 0, 5, b"hello").await.error, 0);
    stop.send(true).unwrap();
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), c.server).await;
    end.expect("the connection did not end").unwrap().unwrap();
    export.image.close().await.unwrap();
    assert_clean(&path);
}
