//! Random sequences of operations applied to a FileStorage and a MemStorage must leave both
//! with the same length and bytes: the in-memory model behaves like a real file.

use qimg_testkit::Rng;
use std::io::IoSlice;

use qimg_io::{
    AllocateOutcome, BlockingStrategy, DiscardOutcome, FileOptions, MemStorage, Storage,
};

const SPAN: u64 = 300_000;

async fn random_ops_agree(seed: u64, blocking: BlockingStrategy) {
    let dir = tempfile::tempdir().unwrap();
    let file = FileOptions::new()
        .read_write(true)
        .create_new(true)
        .blocking(blocking)
        .open(dir.path().join("img"))
        .unwrap();
    let mem = MemStorage::new();
    let mut rng = Rng(seed);
    for step in 0..400 {
        let offset = rng.below(SPAN);
        let len = if rng.below(4) == 0 {
            rng.below(70_000)
        } else {
            rng.below(5000)
        };
        let fill = rng.next() as u8;
        let what = rng.below(7);
        match what {
            0 | 1 => {
                let data = vec![fill; len as usize];
                file.write_at(&data, offset).await.unwrap();
                mem.write_at(&data, offset).await.unwrap();
            }
            2 => {
                let a = vec![fill; (len / 3) as usize];
                let b = vec![fill.wrapping_add(1); (len - len / 3) as usize];
                let iov = [IoSlice::new(&a), IoSlice::new(&[]), IoSlice::new(&b)];
                file.write_vectored_at(&iov, offset).await.unwrap();
                mem.write_vectored_at(&iov, offset).await.unwrap();
            }
            3 => {
                file.write_zeroes(offset, len).await.unwrap();
                mem.write_zeroes(offset, len).await.unwrap();
            }
            4 => {
                if file.discard(offset, len).await.unwrap() == DiscardOutcome::Deallocated {
                    mem.discard(offset, len).await.unwrap();
                }
            }
            5 => {
                if file.allocate(offset, len).await.unwrap() == AllocateOutcome::Reserved {
                    mem.allocate(offset, len).await.unwrap();
                }
            }
            _ => {
                file.set_len(offset).await.unwrap();
                mem.set_len(offset).await.unwrap();
            }
        }
        let flen = file.len().await.unwrap();
        assert_eq!(
            flen,
            mem.len().await.unwrap(),
            "seed {seed} step {step} op {what}"
        );
        let at = rng.below(SPAN);
        let mut a = vec![0u8; 9000];
        let mut b = vec![1u8; 9000];
        file.read_at_zero_fill(&mut a, at).await.unwrap();
        mem.read_at_zero_fill(&mut b, at).await.unwrap();
        assert!(
            a == b,
            "seed {seed} step {step} op {what}: bytes at {at:#x} differ"
        );
    }
    let mut whole = vec![0u8; file.len().await.unwrap() as usize];
    file.read_at(&mut whole, 0).await.unwrap();
    assert!(
        whole == mem.snapshot(),
        "seed {seed}: final contents differ"
    );
}

#[tokio::test]
async fn file_and_memory_agree_on_random_operations() {
    for seed in 1..=4u64 {
        random_ops_agree(
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            BlockingStrategy::Inline,
        )
        .await;
    }
    random_ops_agree(77, BlockingStrategy::SpawnBlocking).await;
}
