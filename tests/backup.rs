//! Incremental backup of a running disk (issue 32): checkpoints taken by one transaction
//! between guest requests, the control socket of `qimg serve --monitor`, and `qimg backup`.

mod common;
use common::*;

use qimg::{Action, OpenOptions};

/// A write that recorded itself in the bitmaps before a checkpoint and runs after it is in
/// the checkpoint's new bitmap: every cluster is then either in the snapshot and in the old
/// bitmap, or not in the snapshot and in the new one. The writers are made to wait for their
/// range lock behind a checkpoint (a lease holds their clusters, the checkpoint asks for
/// every range first), so the test fails without the rule of `Inner::recorded`.
#[test]
fn a_write_waiting_behind_a_checkpoint_is_in_the_new_bitmap() {
    let d = Scratch::new("checkpoint-order");
    let out = qimg(
        &d.0,
        &["create", "-f", "qcow2", "-o", "extended_l2=on", "a.qcow2", "8M"],
    );
    assert!(out.status.success(), "{out:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let img = OpenOptions::new()
            .writable(true)
            .open(d.path("a.qcow2"))
            .await
            .unwrap();
        img.add_bitmap("b0", Some(65536), true).unwrap();
        let cs = img.cluster_size();
        // Holds clusters 0..8 until dropped.
        let lease = img.write_lease(0, 8 * cs).await.unwrap();
        let checkpoint = tokio::spawn({
            let img = img.clone();
            async move {
                img.transaction(&[
                    Action::Snapshot { name: "ck1".into() },
                    Action::EnableBitmap {
                        name: "b0".into(),
                        enabled: false,
                    },
                    Action::AddBitmap {
                        name: "b1".into(),
                        granularity: Some(65536),
                        enabled: true,
                    },
                ])
                .await
            }
        });
        // The checkpoint reaches its wait for every range before the writers start.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        let writers: Vec<_> = (0..8u64)
            .map(|i| {
                let img = img.clone();
                tokio::spawn(async move { img.write(&[i as u8 + 1; 4096], i * cs).await })
            })
            .collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        lease.abort().await;
        checkpoint.await.unwrap().unwrap();
        for w in writers {
            w.await.unwrap().unwrap();
        }
        let b0 = img.dirty_bitmap("b0").await.unwrap();
        let b1 = img.dirty_bitmap("b1").await.unwrap();
        for i in 0..8u64 {
            // The writes ran after the checkpoint (it held every range first): each must be
            // in b1, or the next incremental backup would miss it. (b0 has them too: they
            // recorded themselves before; a superset is what a bitmap may be.)
            assert!(
                !b1.extents(i * cs, cs).is_empty(),
                "cluster {i}: written after the checkpoint, not in b1"
            );
            assert!(!b0.extents(i * cs, cs).is_empty());
        }
        img.close().await.unwrap();
    });
    // The snapshot holds none of the writes: they came after the checkpoint.
    let out = qimg(
        &d.0,
        &["convert", "-l", "ck1", "-O", "raw", "a.qcow2", "ck1.raw"],
    );
    assert!(out.status.success(), "{out:?}");
    let ck1 = std::fs::read(d.path("ck1.raw")).unwrap();
    assert!(ck1.iter().all(|&b| b == 0), "the snapshot saw a later write");
}
