//! Runs the shared conformance suite against every backend of this crate.

use std::sync::atomic::{AtomicU32, Ordering};

use qimg_io::conformance::{assert_futures_are_send, run_all};
use qimg_io::{BlockingStrategy, FaultyStorage, FileOptions, FileStorage, MemStorage, Storage};

/// A factory of fresh, empty files in one temporary directory.
fn files(dir: &tempfile::TempDir, opts: FileOptions) -> impl Fn() -> FileStorage + '_ {
    static N: AtomicU32 = AtomicU32::new(0);
    move || {
        let path = dir
            .path()
            .join(format!("f{}", N.fetch_add(1, Ordering::Relaxed)));
        opts.clone()
            .read_write(true)
            .create_new(true)
            .open(&path)
            .expect("create test file")
    }
}

/// Compile-time: the futures of the concrete backends are `Send`.
#[allow(dead_code)]
fn concrete_futures_are_send(f: &FileStorage, m: &MemStorage, ff: &FaultyStorage<FileStorage>) {
    assert_futures_are_send(f);
    assert_futures_are_send(ff);
    assert_futures_are_send(m);
    assert_futures_are_send(&std::sync::Arc::new(m.clone()));
    fn spawnable<T: Send + 'static>(_: T) {}
    let m = m.clone();
    spawnable(async move {
        let mut b = [0u8; 4];
        m.read_at(&mut b, 0).await
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mem_storage_conforms() {
    run_all(MemStorage::new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mem_storage_with_alignment_conforms() {
    run_all(|| MemStorage::new().with_alignment(4096, 512)).await;
    run_all(|| MemStorage::new().with_alignment(512, 4096)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_storage_conforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    run_all(files(&dir, FileOptions::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_storage_on_the_blocking_pool_conforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    run_all(files(
        &dir,
        FileOptions::new().blocking(BlockingStrategy::SpawnBlocking),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_storage_without_fallocate_conforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    run_all(files(&dir, FileOptions::new().fallocate(false))).await;
    run_all(files(
        &dir,
        FileOptions::new()
            .fallocate(false)
            .blocking(BlockingStrategy::SpawnBlocking),
    ))
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn file_storage_conforms_on_a_current_thread_runtime() {
    let dir = tempfile::tempdir().expect("tempdir");
    run_all(files(&dir, FileOptions::new())).await;
}

/// Whether the directory's file system accepts O_DIRECT.
fn supports_direct(dir: &tempfile::TempDir) -> bool {
    match FileOptions::new()
        .read_write(true)
        .create_new(true)
        .direct(true)
        .open(dir.path().join("probe"))
    {
        Ok(_) => true,
        Err(e) => {
            println!(
                "skipping O_DIRECT: {e} ({:?})",
                std::error::Error::source(&e)
            );
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_storage_with_o_direct_conforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    if !supports_direct(&dir) {
        return;
    }
    run_all(files(&dir, FileOptions::new().direct(true))).await;
    run_all(files(
        &dir,
        FileOptions::new()
            .direct(true)
            .blocking(BlockingStrategy::SpawnBlocking),
    ))
    .await;
    run_all(files(
        &dir,
        FileOptions::new().direct(true).fallocate(false),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulty_storage_without_faults_conforms() {
    run_all(|| FaultyStorage::in_memory(&[])).await;
    run_all(|| {
        FaultyStorage::with_baseline(
            MemStorage::new().with_alignment(4096, 512),
            &MemStorage::new(),
        )
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let make = files(&dir, FileOptions::new());
    run_all(|| FaultyStorage::with_baseline(make(), &MemStorage::new())).await;
    if supports_direct(&dir) {
        let make = files(&dir, FileOptions::new().direct(true));
        run_all(|| FaultyStorage::with_baseline(make(), &MemStorage::new())).await;
    }
}
