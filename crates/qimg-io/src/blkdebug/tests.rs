//! Tests of the blkdebug rules and breakpoints.

use super::*;
use crate::MemStorage;

fn run<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

fn errno(r: Result<()>) -> Option<i32> {
    r.err().map(|e| e.raw_os_error().unwrap())
}

#[test]
fn config_files_parse_as_qemus() {
    let c = BlkdebugConfig::parse_file(
        "# a comment\n[inject-error]\nevent = \"l2_update\"\nerrno = \"28\"\nonce = \"on\"\n\n\
         [set-state]\nevent = \"write_aio\"\nnew_state = \"2\"\n",
    )
    .unwrap();
    assert_eq!(c.inject.len(), 1);
    assert_eq!(c.inject[0].event, DebugEvent::L2Update);
    assert_eq!((c.inject[0].errno, c.inject[0].once), (28, true));
    assert_eq!(c.set_state[0].new_state, 2);
    let e = BlkdebugConfig::parse_file("[inject-error]\nevent = \"nope\"\n").unwrap_err();
    assert!(e.contains("nope"), "{e}");
    let e = BlkdebugConfig::parse_file("event = \"l2_load\"\n").unwrap_err();
    assert!(e.contains("no group"), "{e}");
    let mut c = BlkdebugConfig::default();
    let rest = c
        .from_options(&[
            ("inject-error.0.event".into(), "write_aio".into()),
            ("inject-error.0.sector".into(), "8".into()),
            ("align".into(), "4096".into()),
        ])
        .unwrap();
    assert_eq!(rest, ["align"]);
    assert_eq!(c.inject[0].offset, Some(4096));
    assert_eq!(c.inject[0].errno, 5);
}

#[test]
fn rules_fire_after_their_event_once_or_until_replaced() {
    let c = BlkdebugConfig::parse_file(
        "[inject-error]\nevent = \"l2_update\"\nonce = \"on\"\n\
         [inject-error]\nevent = \"write_aio\"\nerrno = \"28\"\niotype = \"write\"\n",
    )
    .unwrap();
    let s = BlkdebugStorage::new(MemStorage::new(), c);
    run(async {
        // Nothing is active before an event.
        assert_eq!(errno(s.write_at(&[1; 512], 0).await), None);
        s.debug_event(DebugEvent::L2Update);
        assert_eq!(errno(s.flush().await), Some(5));
        // Once: gone, also for the next l2_update.
        assert_eq!(errno(s.flush().await), None);
        s.debug_event(DebugEvent::L2Update);
        assert_eq!(errno(s.write_at(&[1; 512], 0).await), None);
        // Not once: every write from now on, but not reads (iotype).
        s.debug_event(DebugEvent::WriteAio);
        assert_eq!(errno(s.write_at(&[1; 512], 0).await), Some(28));
        assert_eq!(errno(s.write_at(&[1; 512], 512).await), Some(28));
        let mut b = [0; 512];
        assert_eq!(errno(s.read_at(&mut b, 0).await), None);
    });
}

#[test]
fn sectors_and_states_select_requests_and_events() {
    let c = BlkdebugConfig::parse_file(
        "[inject-error]\nevent = \"l2_load\"\nsector = \"2\"\nstate = \"2\"\n\
         [set-state]\nevent = \"l2_load\"\nstate = \"1\"\nnew_state = \"2\"\n",
    )
    .unwrap();
    let s = BlkdebugStorage::new(MemStorage::new(), c);
    run(async {
        s.write_at(&[1; 4096], 0).await.unwrap();
        let mut b = [0; 512];
        // State 1: the event moves to state 2 and activates nothing.
        s.debug_event(DebugEvent::L2Load);
        assert_eq!(s.state(), 2);
        assert_eq!(errno(s.read_at(&mut b, 1024).await), None);
        // State 2: active, for the request covering sector 2 only.
        s.debug_event(DebugEvent::L2Load);
        assert_eq!(errno(s.read_at(&mut b, 0).await), None);
        assert_eq!(errno(s.read_at(&mut b, 1024).await), Some(5));
    });
}

#[test]
fn a_request_stops_at_its_breakpoint_until_resumed() {
    use std::sync::Arc;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let s = Arc::new(BlkdebugStorage::new(
            MemStorage::new(),
            BlkdebugConfig::default(),
        ));
        let bp = s.breakpoints().clone();
        assert_eq!(bp.add("nosuch", "A"), Err(NoSuchBreakpoint));
        bp.add("write_aio", "A").unwrap();
        assert_eq!(bp.resume("A"), Err(NoSuchBreakpoint));
        // The event before the write hits the breakpoint: the write stops before it starts.
        s.debug_event(DebugEvent::WriteAio);
        let writer = s.clone();
        let write = tokio::task::spawn_local(async move { writer.write_at(&[7; 512], 0).await });
        tokio::task::yield_now().await;
        assert!(bp.is_suspended("A") && !write.is_finished());
        assert_eq!(s.inner().len().await.unwrap(), 0, "nothing written yet");
        bp.resume("A").unwrap();
        write.await.unwrap().unwrap();
        assert_eq!(s.inner().len().await.unwrap(), 512);
        // Fired once: the next write_aio does not stop.
        s.debug_event(DebugEvent::WriteAio);
        s.write_at(&[8; 512], 512).await.unwrap();
        // release_all lets a stopped request go and drops the rest.
        bp.add("flush_to_disk", "B").unwrap();
        bp.add("read_aio", "C").unwrap();
        s.debug_event(DebugEvent::FlushToDisk);
        let flusher = s.clone();
        let flush = tokio::task::spawn_local(async move { flusher.flush().await });
        tokio::task::yield_now().await;
        assert_eq!(bp.suspended(), 1);
        bp.release_all();
        flush.await.unwrap().unwrap();
        assert_eq!(bp.remove("C"), Err(NoSuchBreakpoint));
    });
}
