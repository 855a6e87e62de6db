//! Clients that break the rules: each gets an error or a closed connection, never a panic or
//! unbounded memory, and the server keeps serving the others. Then many clients at once.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use qimg_serve::nbd::Error;
use qimg_serve::nbd::proto::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: u64 = 1 << 20;

/// A second client can still read what was written, proving the export still serves.
async fn still_serves(export: &Arc<qimg_serve::nbd::Export>) {
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", true, &["base:allocation"]).await;
    let r = c.call(CMD_READ, 0, 0, 4096, &[]).await;
    assert_eq!(r.error, 0);
    c.disconnect().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", true, &["base:allocation"]).await;
    // Past the end, and an offset whose end overflows.
    assert_eq!(c.call(CMD_READ, 0, MIB - 10, 4096, &[]).await.error, EINVAL);
    assert_eq!(
        c.call(CMD_READ, 0, u64::MAX - 1, 4096, &[]).await.error,
        EINVAL
    );
    assert_eq!(
        c.call(CMD_WRITE, 0, MIB, 16, &[9u8; 16]).await.error,
        EINVAL
    );
    assert_eq!(c.call(CMD_TRIM, 0, MIB, 1, &[]).await.error, EINVAL);
    assert_eq!(c.call(CMD_BLOCK_STATUS, 0, MIB, 1, &[]).await.error, EINVAL);
    // A read over the maximum block size.
    assert_eq!(
        c.call(CMD_READ, 0, 0, MAX_PAYLOAD + 1, &[]).await.error,
        EINVAL
    );
    // An unknown command, an unknown flag, a flag of another command.
    assert_eq!(c.call(42, 0, 0, 0, &[]).await.error, EINVAL);
    assert_eq!(c.call(CMD_READ, 1 << 9, 0, 512, &[]).await.error, EINVAL);
    assert_eq!(
        c.call(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 4, b"abcd")
            .await
            .error,
        EINVAL
    );
    assert_eq!(c.call(CMD_FLUSH, 0, 4096, 0, &[]).await.error, EINVAL);
    // None of these wrote anything.
    let r = c.call(CMD_READ, 0, 0, 4096, &[]).await;
    assert!(r.data.iter().all(|&b| b == 0));
    c.disconnect().await;
    export.image.close().await.unwrap();
    assert_clean(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_write_closes_only_that_connection() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", 64 * MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", false, &[]).await;
    c.send(CMD_WRITE, 0, 1, 0, MAX_PAYLOAD + 1, &[]).await;
    let (handle, r) = c.reply(0, 0).await;
    assert_eq!((handle, r.error), (1, EINVAL));
    let end = c.server.await.unwrap();
    assert!(matches!(end, Err(Error::PayloadTooBig { .. })), "{end:?}");
    still_serves(&export).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_a_read_only_export_get_eperm_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let before = std::fs::read(&path).unwrap();
    let img = qimg::OpenOptions::new()
        .writable(true)
        .open(&path)
        .await
        .unwrap();
    let mut e = qimg_serve::nbd::Export::new(img);
    e.read_only = true;
    let export = Arc::new(e);
    let mut c = connect_raw(export.clone(), 1 << 20);
    let flags = c.go("", true, &[]).await;
    assert_eq!(flags & TF_READ_ONLY, TF_READ_ONLY);
    assert_eq!(c.call(CMD_WRITE, 0, 0, 4, b"abcd").await.error, EPERM);
    assert_eq!(c.call(CMD_WRITE_ZEROES, 0, 0, 4096, &[]).await.error, EPERM);
    assert_eq!(c.call(CMD_TRIM, 0, 0, 4096, &[]).await.error, EPERM);
    assert_eq!(c.call(CMD_READ, 0, 0, 4, &[]).await.error, 0);
    // Flushing a read-only export is allowed (and has nothing to do).
    assert_eq!(c.call(CMD_FLUSH, 0, 0, 0, &[]).await.error, 0);
    c.disconnect().await;
    export.image.close().await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_messages_end_the_connection_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let export = export(&path).await;
    // Half a request header.
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", false, &[]).await;
    c.s.write_all(&REQUEST_MAGIC.to_be_bytes()).await.unwrap();
    c.s.write_all(&[0, 0, 0]).await.unwrap();
    drop(c.s);
    assert!(matches!(c.server.await.unwrap(), Err(Error::Io(_))));
    // A write whose payload is cut short: the connection ends at once (the request never
    // ran, so there is no reply to wait for; it used to be counted in flight and kept the
    // connection draining until its 10-second timeout, a fuzz finding).
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", false, &[]).await;
    c.send(CMD_WRITE, 0, 1, 0, 4096, &[1u8; 100]).await;
    // The connection ends within 50 ms on a quiet machine; the bug this catches waited for
    // the 10 s drain timeout, above the guard's 5 s.
    let guard = qimg_testkit::HangGuard::start(
        "the end of a connection whose write payload never came",
        Duration::from_millis(50),
        Duration::from_secs(5),
    );
    drop(c.s);
    assert!(matches!(c.server.await.unwrap(), Err(Error::Io(_))));
    guard.check();
    // An option cut short, and a bad request magic.
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    c.s.write_all(&IHAVEOPT.to_be_bytes()).await.unwrap();
    c.s.write_all(&OPT_GO.to_be_bytes()).await.unwrap();
    c.s.write_all(&100u32.to_be_bytes()).await.unwrap();
    c.s.write_all(&[0u8; 10]).await.unwrap();
    drop(c.s);
    assert!(matches!(c.server.await.unwrap(), Err(Error::Io(_))));
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", false, &[]).await;
    c.s.write_all(&[0xffu8; 28]).await.unwrap();
    assert!(matches!(
        c.server.await.unwrap(),
        Err(Error::BadMagic { .. })
    ));
    // Unknown client flags.
    let mut c = connect_raw(export.clone(), 1 << 20);
    let mut g = [0u8; 18];
    c.s.read_exact(&mut g).await.unwrap();
    c.s.write_u32(1 << 7).await.unwrap();
    assert!(matches!(
        c.server.await.unwrap(),
        Err(Error::ClientFlags(0x80))
    ));
    still_serves(&export).await;
    export.image.close().await.unwrap();
    assert_clean(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_option_over_the_limit_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    // Announce 4 GiB - 1 of option data and send none of it.
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_GO.to_be_bytes());
    m.extend_from_slice(&u32::MAX.to_be_bytes());
    c.s.write_all(&m).await.unwrap();
    assert_eq!(c.option_reply().await.0, REP_ERR_TOO_BIG);
    let end = c.server.await.unwrap();
    assert!(
        matches!(end, Err(Error::OptionTooBig { len: u32::MAX, .. })),
        "{end:?}"
    );
    // A string over 4096 bytes inside an option of acceptable size: ERR_INVALID.
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    let mut d = 5000u32.to_be_bytes().to_vec();
    d.extend_from_slice(&[b'a'; 5000]);
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(OPT_GO, &d).await;
    assert_eq!(c.option_reply().await.0, REP_ERR_INVALID);
    // A meta context count the data cannot hold.
    let mut d = 0u32.to_be_bytes().to_vec();
    d.extend_from_slice(&u32::MAX.to_be_bytes());
    c.option(OPT_LIST_META_CONTEXT, &d).await;
    assert_eq!(c.option_reply().await.0, REP_ERR_INVALID);
    drop(c);
    still_serves(&export).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_replies_stops_being_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", 64 * MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 64 << 10);
    c.go("", false, &[]).await;
    // Ask for 1 MiB reads and never read a reply: after the in-flight budget (64 MiB) the
    // server stops reading, and the pipe (64 KiB) fills up.
    let mut sent = 0u64;
    let stalled = loop {
        let send = c.send(CMD_READ, 0, sent, 0, MIB as u32, &[]);
        if tokio::time::timeout(Duration::from_secs(2), send)
            .await
            .is_err()
        {
            break true;
        }
        sent += 1;
        if sent > 10_000 {
            break false;
        }
    };
    assert!(
        stalled,
        "the server read {sent} requests without their replies being read"
    );
    // The budget allows 64 MiB of replies (64 requests) plus what fits the pipe and the
    // server's input buffer (64 KiB of requests read ahead).
    assert!(
        sent <= 64 + 2 * (64 << 10) / 28 + 1,
        "{sent} requests were read"
    );
    still_serves(&export).await;
    // The stuck client leaves: its connection ends.
    drop(c.s);
    let end = tokio::time::timeout(Duration::from_secs(30), c.server).await;
    assert!(
        end.is_ok(),
        "the connection of a departed client did not end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_with_mixed_requests_leave_the_image_as_the_model() {
    sixteen_clients(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_through_per_connection_queues_leave_the_image_as_the_model() {
    sixteen_clients(true).await;
}

async fn sixteen_clients(queued: bool) {
    let dir = tempfile::tempdir().unwrap();
    let size = 16 * MIB;
    let path = make_image(dir.path(), "a.qcow2", size, true);
    let export = export_with(&path, queued).await;
    let region = size / 16;
    let mut clients = Vec::new();
    for id in 0..16u64 {
        let export = export.clone();
        clients.push(tokio::spawn(async move {
            // Each client owns one region, so the model does not depend on timing; the
            // regions share L2 tables and refcount blocks, which is what is exercised.
            let base = id * region;
            let mut model = vec![0u8; region as usize];
            let mut c = connect_raw(export, 1 << 20);
            c.go("", id % 2 == 0, &[]).await;
            let mut seed = id * 7919 + 1;
            let mut next = || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            for i in 0..60u64 {
                let off = next() % (region - 70_000);
                let len = 1 + next() % 70_000;
                let o = off as usize;
                let l = len as usize;
                match next() % 5 {
                    0 | 1 => {
                        let fill = (i as u8).wrapping_add(id as u8) | 1;
                        let data = vec![fill; l];
                        let flags = if i % 7 == 0 { CMD_FLAG_FUA } else { 0 };
                        let r = c
                            .call(CMD_WRITE, flags, base + off, len as u32, &data)
                            .await;
                        assert_eq!(r.error, 0);
                        model[o..o + l].fill(fill);
                    }
                    2 => {
                        let flags = if i % 2 == 0 { CMD_FLAG_NO_HOLE } else { 0 };
                        let r = c
                            .call(CMD_WRITE_ZEROES, flags, base + off, len as u32, &[])
                            .await;
                        assert_eq!(r.error, 0);
                        model[o..o + l].fill(0);
                    }
                    3 => {
                        let r = c.call(CMD_READ, 0, base + off, len as u32, &[]).await;
                        assert_eq!(r.error, 0);
                        assert!(r.data == model[o..o + l], "client {id} read {len} at {off}");
                    }
                    _ => assert_eq!(c.call(CMD_FLUSH, 0, 0, 0, &[]).await.error, 0),
                }
            }
            c.disconnect().await;
            model
        }));
    }
    let mut model = Vec::new();
    for c in clients {
        model.extend(c.await.unwrap());
    }
    assert_image_is(&export, &path, &model).await;
}

/// Closes the export's image, which must then check clean and read as `model`.
async fn assert_image_is(export: &qimg_serve::nbd::Export, path: &std::path::Path, model: &[u8]) {
    export.image.close().await.unwrap();
    assert_clean(path);
    let img = qimg::OpenOptions::new().open(path).await.unwrap();
    let mut all = vec![0u8; model.len()];
    img.read(&mut all, 0).await.unwrap();
    assert!(all == model, "the image differs from the model");
}

/// One client keeps 48 requests in flight: batches of writes and write-zeroes to disjoint
/// ranges (payloads that straddle the server's input buffer), then batches of reads of any
/// range, answered out of order; every read must match the model, and so must the image.
async fn pipelined(queued: bool, extended_l2: bool) {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let path = make_image(dir.path(), "a.qcow2", size, extended_l2);
    let export = export_with(&path, queued).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.go("", true, &[]).await;
    let mut model = vec![0u8; size as usize];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(queued) ^ (u64::from(extended_l2) << 1);
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    const BATCH: u64 = 48;
    let slot = size / BATCH;
    for round in 0..12u64 {
        // Writes: one per slot, so that none overlaps another in flight.
        let mut sent = Vec::new();
        for i in 0..BATCH {
            let len = 1 + next() % (slot - 1).min(100_000);
            let off = i * slot + next() % (slot - len);
            let (o, l) = (off as usize, len as usize);
            let handle = round * 1000 + i;
            if next() % 4 == 0 {
                c.send(CMD_WRITE_ZEROES, 0, handle, off, len as u32, &[])
                    .await;
                model[o..o + l].fill(0);
            } else {
                let fill = (next() as u8) | 1;
                let flags = if next() % 8 == 0 { CMD_FLAG_FUA } else { 0 };
                let data = vec![fill; l];
                c.send(CMD_WRITE, flags, handle, off, len as u32, &data)
                    .await;
                model[o..o + l].fill(fill);
            }
            sent.push(handle);
        }
        let mut got = Vec::new();
        for _ in 0..BATCH {
            let (handle, r) = c.reply(0, 0).await;
            assert_eq!(r.error, 0, "round {round}: request {handle} failed");
            got.push(handle);
        }
        got.sort_unstable();
        assert_eq!(got, sent, "round {round}: a reply is missing or doubled");
        // Reads of any range, all in flight at once.
        let mut reads = std::collections::HashMap::new();
        for i in 0..BATCH {
            let len = 1 + next() % 150_000;
            let off = next() % (size - len);
            let handle = round * 1000 + 500 + i;
            c.send(CMD_READ, 0, handle, off, len as u32, &[]).await;
            reads.insert(handle, (off, len));
        }
        for _ in 0..BATCH {
            let (handle, r) = c.read_reply_any(&reads).await;
            let (off, len) = reads[&handle];
            assert_eq!(r.error, 0, "round {round}: read {handle} failed");
            let (o, l) = (off as usize, len as usize);
            assert!(
                r.data == model[o..o + l],
                "round {round}: read of {len} at {off} differs from the model"
            );
        }
    }
    c.disconnect().await;
    assert_image_is(&export, &path, &model).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_through_the_engine_match_the_model() {
    pipelined(false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_through_a_queue_match_the_model() {
    pipelined(true, true).await;
    pipelined(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_idles_in_the_handshake_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = make_image(dir.path(), "a.qcow2", MIB, true);
    let export = export(&path).await;
    let mut c = connect_raw(export.clone(), 1 << 20);
    c.greet().await;
    let start = std::time::Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(30), c.server)
        .await
        .unwrap();
    assert!(matches!(end.unwrap(), Err(Error::HandshakeTimeout(_))));
    assert!(start.elapsed() >= qimg_serve::nbd::HANDSHAKE_TIMEOUT - Duration::from_secs(1));
}
