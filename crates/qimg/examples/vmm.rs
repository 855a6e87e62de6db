//! Embedding qimg the way a virtual machine monitor would.
//!
//! ```sh
//! cargo run --example vmm [DIR]
//! ```
//!
//! 1. Creates a raw "golden image" filled with a pattern and a qcow2 overlay with extended L2
//!    entries (64 KiB clusters, 32 subclusters of 2 KiB) on top of it.
//! 2. Opens the overlay read-write on a multi-thread tokio runtime with a deliberately small L2
//!    cache (so slices are evicted and written back) and a one-second cache-clean interval
//!    (so the clean timer task, spawned at open, has something to do).
//! 3. Runs several "vCPU queues" at once, each a task sharing the same `Image` handle: 4 KiB
//!    guest writes, a few 512-byte sector writes (when their 2 KiB subcluster is not allocated
//!    yet, the rest of it is copied from the backing file or zeros), reads checked against
//!    what the task wrote, and guest FLUSH commands. The tasks own interleaved 4 KiB blocks, so they write into the same
//!    clusters concurrently but never into the same bytes.
//! 4. Issues a TRIM (discard) and a WRITE ZEROES, then three writes the way a VMM with its own
//!    io_uring does them (`write_lease`: qimg allocates and copies on write, the VMM writes the
//!    guest bytes at the host offsets it is given, `commit` links them), a final FLUSH, prints
//!    `stats()`, waits for the clean timer to empty the caches, and closes.
//! 5. Verifies every byte of the disk twice: through the async image before closing and
//!    through the blocking facade after reopening read-only. When `qemu-img` is installed it
//!    also runs `qemu-img check` and `qemu-img compare` against the expected contents.
//!
//! Files go to DIR (kept afterwards) or to a fresh directory under the system temporary
//! directory (removed afterwards).

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use qimg::tools::create::{CreateOptions, create};
use qimg::{CacheOptions, Image, OpenOptions};

type AnyResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Virtual disk size.
const DISK: u64 = 64 * MIB;
/// The raw backing file is smaller than the disk: past its end the guest reads zeros.
const BACKING: u64 = 24 * MIB;
const CLUSTER: u64 = 64 * KIB;
/// Guest block size.
const BLOCK: u64 = 4 * KIB;
const SECTOR: u64 = 512;
/// Concurrent request queues.
const QUEUES: u64 = 4;
/// Requests per queue.
const REQUESTS: u64 = 600;

/// A small deterministic generator (splitmix64), so the example needs no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The golden image's byte at `offset`.
fn backing_byte(offset: u64) -> u8 {
    ((offset / SECTOR) as u8).wrapping_mul(31) ^ (offset as u8)
}

/// What a guest write stores: recognisable per queue and request.
fn payload(queue: u64, request: u64, len: u64) -> Vec<u8> {
    let tag = ((queue << 5) | (request % 32)) as u8;
    (0..len).map(|i| tag ^ (i as u8).wrapping_mul(7)).collect()
}

/// The expected guest contents, shared by the queues. Each queue only touches the blocks it
/// owns, so the order in which queues update it does not matter.
type Model = Arc<Mutex<Vec<u8>>>;

fn model_write(model: &Model, offset: u64, data: &[u8]) {
    let mut m = model.lock().unwrap_or_else(|e| e.into_inner());
    m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
}

fn model_read(model: &Model, offset: u64, len: u64) -> Vec<u8> {
    let m = model.lock().unwrap_or_else(|e| e.into_inner());
    m[offset as usize..(offset + len) as usize].to_vec()
}

/// What the guest sees where nothing was written: the backing file, then zeros.
fn unwritten(offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len)
        .map(|o| if o < BACKING { backing_byte(o) } else { 0 })
        .collect()
}

fn main() -> AnyResult<()> {
    let (dir, keep) = match std::env::args_os().nth(1) {
        Some(d) => (PathBuf::from(d), true),
        None => (
            std::env::temp_dir().join(format!("qimg-vmm-{}", std::process::id())),
            false,
        ),
    };
    std::fs::create_dir_all(&dir)?;
    let base = dir.join("vmm-base.raw");
    let disk = dir.join("vmm-disk.qcow2");

    // The golden image.
    let golden: Vec<u8> = (0..BACKING).map(backing_byte).collect();
    std::fs::write(&base, &golden)?;
    drop(golden);

    // The overlay: extended L2, raw backing file stored by relative name.
    let _ = std::fs::remove_file(&disk);
    let opts = CreateOptions {
        size: Some(DISK),
        cluster_size: CLUSTER,
        extended_l2: true,
        backing_file: Some("vmm-base.raw".into()),
        backing_fmt: Some("raw".into()),
        ..Default::default()
    };
    create(&disk, &opts, &mut |_, _| {})?;
    println!(
        "created {} ({} MiB, {} KiB clusters, extended L2) over {} ({} MiB raw)",
        disk.display(),
        DISK / MIB,
        CLUSTER / KIB,
        base.display(),
        BACKING / MIB
    );

    let model: Model = Arc::new(Mutex::new(unwritten(0, DISK)));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(QUEUES as usize)
        .enable_all()
        .build()?;
    rt.block_on(run_guest(&disk, model.clone()))?;
    drop(rt);

    // Reopen read-only through the blocking facade (no runtime of our own needed) and
    // compare every byte again.
    let expected = model.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let img = OpenOptions::new().open_blocking(&disk)?;
    let mut buf = vec![0u8; MIB as usize];
    for at in (0..DISK).step_by(MIB as usize) {
        img.read(&mut buf, at)?;
        check(
            &buf,
            &expected[at as usize..(at + MIB) as usize],
            at,
            "after reopen",
        )?;
    }
    img.close()?;
    println!(
        "reopened read-only with BlockingImage: all {} MiB as expected",
        DISK / MIB
    );

    qemu_img_cross_check(&dir, &disk, &expected)?;

    if !keep {
        std::fs::remove_dir_all(&dir)?;
    }
    println!("ok");
    Ok(())
}

async fn run_guest(disk: &Path, model: Model) -> AnyResult<()> {
    let opts = OpenOptions::new().writable(true).cache(CacheOptions {
        // Two L2 slices of 4 KiB: the disk's 1024 extended entries take four, so the
        // working set does not fit and dirty slices are evicted and written back.
        l2_cache_size: Some(8 * KIB),
        l2_cache_entry_size: Some(4 * KIB),
        cache_clean_interval: Some(1),
        ..Default::default()
    });
    let image = opts.open(disk).await?;
    println!(
        "opened: cluster {} KiB, subcluster {} KiB, extended L2 {}, writable {}",
        image.cluster_size() / KIB,
        image.subcluster_size() / KIB,
        image.extended_l2(),
        image.is_writable()
    );

    let started = Instant::now();
    let mut queues = Vec::new();
    for q in 0..QUEUES {
        // `Image` is a cheap handle; every queue gets its own clone.
        queues.push(tokio::spawn(queue(image.clone(), model.clone(), q)));
    }
    let mut done = 0;
    for task in queues {
        done += task.await??;
    }
    println!(
        "{QUEUES} queues completed {done} requests in {:.2?}",
        started.elapsed()
    );

    // TRIM a cluster-aligned range: it reads from the backing file again.
    let (trim_at, trim_len) = (3 * MIB, 256 * KIB);
    image.discard(trim_at, trim_len).await?;
    model_write(&model, trim_at, &unwritten(trim_at, trim_len));
    // WRITE ZEROES over a range that starts and ends inside subclusters: the whole
    // subclusters only change metadata, the partial ends are written.
    let (zero_at, zero_len) = (5 * MIB + 3 * KIB, 200 * KIB);
    image.write_zeroes(zero_at, zero_len).await?;
    model_write(&model, zero_at, &vec![0u8; zero_len as usize]);

    // Zero-copy writes: the VMM's own I/O puts guest bytes where qimg says (here a plain
    // `pwrite` on a second descriptor; a VMM would submit them to its own io_uring). qimg
    // allocates, copies on write what the guest does not cover, and links on commit.
    let own_fd = std::fs::OpenOptions::new()
        .write(true)
        .open(image.data_path())?;
    for (i, at) in [7 * MIB + 512, 9 * MIB + 100 * KIB, 40 * MIB - 6 * KIB]
        .into_iter()
        .enumerate()
    {
        let data = payload(QUEUES + i as u64, 0, 12 * KIB);
        let lease = image.write_lease(at, data.len() as u64).await?;
        for e in lease.extents() {
            let from = (e.guest_offset - at) as usize;
            std::os::unix::fs::FileExt::write_all_at(
                &own_fd,
                &data[from..from + e.length as usize],
                e.host_offset,
            )?;
        }
        // Only once the writes have completed.
        lease.commit().await?;
        model_write(&model, at, &data);
    }
    println!("3 guest writes issued by the VMM itself through write leases");

    // The guest's FLUSH: metadata written back in the safe order, then fsync (which also
    // covers what the VMM wrote through its own descriptor).
    image.flush().await?;

    let s = image.stats().await;
    println!("stats after the workload:");
    println!(
        "  copy-on-write {} bytes, clusters allocated {}, clusters freed {}",
        s.cow_bytes, s.clusters_allocated, s.clusters_freed
    );
    for (name, c) in [
        ("L2 cache", s.l2_cache),
        ("refcount cache", s.refcount_cache),
    ] {
        println!(
            "  {name}: hits {}, misses {}, evictions {} ({} dirty), idle drops {}, \
             {} slices / {} bytes held, {} dirty",
            c.hits,
            c.misses,
            c.evictions,
            c.dirty_evictions,
            c.idle_drops,
            c.entries,
            c.bytes_held,
            c.dirty_entries
        );
    }
    if s.clusters_allocated == 0 || s.cow_bytes == 0 {
        return Err("the workload should have allocated clusters and copied on write".into());
    }

    // Every byte, through the open image.
    let mut buf = vec![0u8; MIB as usize];
    for at in (0..DISK).step_by(MIB as usize) {
        image.read(&mut buf, at).await?;
        check(&buf, &model_read(&model, at, MIB), at, "before close")?;
    }
    println!("read back all {} MiB while open: as expected", DISK / MIB);

    // Idle: the clean timer (spawned at open on this runtime) writes back and drops
    // slices unused for a whole interval.
    let idle_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = image.stats().await;
        if s.l2_cache.entries == 0 && s.refcount_cache.entries == 0 {
            println!(
                "clean timer emptied both caches after {:.1?} idle \
                 (idle drops: L2 {}, refcount {})",
                idle_since.elapsed(),
                s.l2_cache.idle_drops,
                s.refcount_cache.idle_drops
            );
            break;
        }
        if idle_since.elapsed() > Duration::from_secs(15) {
            return Err(format!(
                "the clean timer did not empty the caches: L2 holds {} slices, refcount {}",
                s.l2_cache.entries, s.refcount_cache.entries
            )
            .into());
        }
    }

    image.close().await?;
    println!("closed");
    Ok(())
}

/// One request queue: writes, sector writes, checked reads and flushes on the blocks it owns
/// (block index modulo QUEUES). Returns the number of requests done.
async fn queue(image: Image<qimg::io::AnyStorage>, model: Model, q: u64) -> AnyResult<u64> {
    let blocks = DISK / BLOCK / QUEUES;
    let mut rng = Rng(0x5EED ^ q);
    let mut written: Vec<u64> = Vec::new();
    for r in 0..REQUESTS {
        let block = rng.below(blocks) * QUEUES + q;
        let at = block * BLOCK;
        match rng.below(20) {
            // A 4 KiB write: two whole 2 KiB subclusters, nothing to copy.
            0..=10 => {
                let data = payload(q, r, BLOCK);
                image.write(&data, at).await?;
                model_write(&model, at, &data);
                written.push(at);
            }
            // A 512-byte write: the rest of its subcluster is copied from the old
            // contents (the backing file, zeros or an earlier write) if not yet allocated.
            11..=13 => {
                let at = at + rng.below(BLOCK / SECTOR) * SECTOR;
                let data = payload(q, r, SECTOR);
                image.write(&data, at).await?;
                model_write(&model, at, &data);
            }
            // Read back a block this queue wrote earlier, or any owned block.
            14..=18 => {
                let at = if written.is_empty() {
                    at
                } else {
                    written[rng.below(written.len() as u64) as usize]
                };
                let mut buf = vec![0u8; BLOCK as usize];
                image.read(&mut buf, at).await?;
                check(
                    &buf,
                    &model_read(&model, at, BLOCK),
                    at,
                    "during the workload",
                )?;
            }
            // The guest's FLUSH command.
            _ => image.flush().await?,
        }
    }
    Ok(REQUESTS)
}

fn check(got: &[u8], want: &[u8], at: u64, when: &str) -> AnyResult<()> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{when}: guest byte {:#x} reads {:#04x}, expected {:#04x}",
            at + i as u64,
            got[i],
            want[i]
        )
        .into()),
    }
}

/// With qemu-img on PATH: `qemu-img check` must find the image clean, and `qemu-img compare`
/// must find it equal to the expected contents.
fn qemu_img_cross_check(dir: &Path, disk: &Path, expected: &[u8]) -> AnyResult<()> {
    let Ok(out) = Command::new("qemu-img").arg("--version").output() else {
        println!("qemu-img not found: skipping the cross-check");
        return Ok(());
    };
    if !out.status.success() {
        println!("qemu-img does not run: skipping the cross-check");
        return Ok(());
    }
    let out = Command::new("qemu-img").arg("check").arg(disk).output()?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img check (exit {:?}): {}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let raw = dir.join("vmm-expected.raw");
    std::fs::write(&raw, expected)?;
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(disk)
        .arg(&raw)
        .output()?;
    let _ = std::fs::remove_file(&raw);
    if !out.status.success() {
        return Err(format!(
            "qemu-img compare (exit {:?}): {}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    println!("qemu-img check: no errors; qemu-img compare: identical to the expected contents");
    Ok(())
}
