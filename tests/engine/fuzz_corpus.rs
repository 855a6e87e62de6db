//! Replays the committed seed corpus of every fuzz target (`fuzz/corpus/<target>/`, made by
//! `fuzz/make-corpus.sh` from qemu-img images) and every saved finding
//! (`fuzz/regressions/<target>/`) through the functions the cargo-fuzz targets call, and
//! checks that the seeds are what the script means them to be (valid slices, images that open
//! and read, clean and damaged images, operation sequences).

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use qimg::tools::check::{CheckOptions, Repair};

use qimg_testkit::fuzzing::format as ffuzz;
use qimg_testkit::fuzzing::{self, corpus as seeds, inputs, inputs_dir};

/// A hang guard, not a speed limit: the slowest input (`check/l1-reserved-bits-repair-quadratic`)
/// takes about 3.6 s in a quiet debug build, so 120 s (over 30 times that) only trips on a
/// hang or an input that went quadratic again, also when both cores are busy. Set
/// `QIMG_FUZZ_TIMES=1` to print each input's time.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Runs `f` on every input, naming the input when it panics or runs past [`HANG_GUARD`].
fn replay(target: &str, inputs: &[(String, Vec<u8>)], f: impl Fn(&[u8])) {
    for (name, data) in inputs {
        let started = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(data)));
        let took = started.elapsed();
        if std::env::var_os("QIMG_FUZZ_TIMES").is_some() {
            eprintln!("{target}/{name}: {took:?}");
        }
        assert!(
            took < HANG_GUARD,
            "{target}/{name}: took {took:?} (hang guard {HANG_GUARD:?})"
        );
        if let Err(e) = r {
            let msg = e
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            panic!("{target}/{name}: {msg}");
        }
    }
}

/// Replays `fuzz/regressions/<target>/`.
fn regressions(target: &str, f: impl Fn(&[u8])) {
    replay(target, &inputs("regressions", target), f);
}

#[test]
fn header_seeds_replay() {
    replay("header", &seeds("header"), ffuzz::header_and_extensions);
}

#[test]
fn l2_slice_seeds_replay_and_decode() {
    let seeds = seeds("l2_slice");
    assert!(seeds.len() >= 15, "{} L2 slices", seeds.len());
    replay("l2_slice", &seeds, ffuzz::l2_slice);
    let mut extended = 0;
    for (name, data) in &seeds {
        let (ctx, base) = ffuzz::l2_context(data[0]);
        let entries = qimg::format::l2::decode_slice(&data[1..], &ctx, base)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            entries
                .iter()
                .any(|e| *e.entry() != qimg::format::l2::L2Entry::Unallocated),
            "{name}: no allocated entry"
        );
        extended += usize::from(ctx.geometry.extended_l2());
    }
    assert!(extended >= 3, "{extended} extended slices");
}

#[test]
fn refcount_block_seeds_replay_for_every_width() {
    let seeds = seeds("refcount_block");
    replay("refcount_block", &seeds, ffuzz::refcount_block);
    let mut orders = [false; 7];
    for (name, data) in seeds.iter().filter(|(n, _)| !n.ends_with("-table")) {
        let order = usize::from(data[0] % 8);
        let values = qimg::format::refcount::decode_block(&data[1..], order as u32)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(values.iter().take(3).all(|&v| v >= 1), "{name}: {values:?}");
        orders[order] = true;
    }
    assert_eq!(orders, [true; 7], "refcount orders with a seed");
}

/// Opens a seed read-only from memory and reads the first `len` bytes.
fn read_seed(name: &str, data: &[u8], len: u64) -> qimg::Result<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let opts = qimg::OpenOptions::new().clean_timer(false);
        let s = qimg::io::MemStorage::from_bytes(data);
        let img = opts.open_storage(s, name, None, None).await?;
        let mut buf = vec![0u8; img.size().min(len) as usize];
        img.read(&mut buf, 0).await?;
        Ok(buf)
    })
}

/// Finding (fixed; open_read seed `comp4k-zstd`, made by `qemu-img convert -c -o
/// compression_type=zstd`): zstd clusters that share a sector with the next compressed cluster
/// did not read. `compress::unzstd` filled the cluster, then fed the rest of the input (the
/// next cluster's frame) to the decoder to see whether the frame inflated further; the decoder
/// started on the next frame and the read failed with "zstd frame inflates beyond the cluster
/// size". QEMU (`qcow2_zstd_decompress`) stops when the cluster is full.
#[test]
fn finding_zstd_clusters_sharing_a_sector_read() {
    let data = std::fs::read(inputs_dir("corpus", "open_read").join("comp4k-zstd")).unwrap();
    let buf = read_seed("comp4k-zstd", &data, 64 << 10).unwrap();
    assert!(buf.iter().all(|&b| b == 0x5a));
}

#[test]
fn open_read_seeds_replay_and_open() {
    let seeds = seeds("open_read");
    assert!(seeds.len() >= 15);
    replay("open_read", &seeds, fuzzing::open_read);
    for (name, data) in &seeds {
        let buf =
            read_seed(name, data, fuzzing::READ_WINDOW).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            buf.iter().any(|&b| b != 0),
            "{name}: no data in the first MiB"
        );
    }
}

#[test]
fn check_seeds_replay_clean_images_stay_clean_damaged_ones_are_repaired() {
    let seeds = seeds("check");
    assert!(seeds.len() >= 15);
    let mut damaged = 0;
    for (name, data) in &seeds {
        let [before, repaired, after] = fuzzing::check(data);
        let (before, repaired, after) = (
            before.unwrap_or_else(|e| panic!("{name}: {e}")),
            repaired.unwrap_or_else(|e| panic!("{name}: {e}")),
            after.unwrap_or_else(|e| panic!("{name}: {e}")),
        );
        let found = before.corruptions + before.leaks;
        // The lazy refcounts image is dirty: a check finds the leaks of its last write.
        if name.starts_with("std4k-") || name.starts_with("ext16k-") || name == "lazy4k" {
            assert!(found > 0, "{name}: nothing found: {before:?}");
            damaged += 1;
            assert!(
                repaired.corruptions_fixed + repaired.leaks_fixed > 0,
                "{name}: nothing repaired: {repaired:?}"
            );
        } else {
            assert_eq!(found, 0, "{name}: {before:?}");
        }
        assert_eq!(
            (after.corruptions, after.leaks, after.check_errors),
            (0, 0, 0),
            "{name}: after repair: {after:?}"
        );
    }
    assert!(damaged >= 7, "{damaged} damaged images");
}

#[test]
fn ops_seeds_replay() {
    let seeds = seeds("ops");
    for (name, data) in &seeds {
        let (_, ops) = fuzzing::decode_ops(data).unwrap();
        assert!(ops.len() >= 5, "{name}: {} operations", ops.len());
    }
    replay("ops", &seeds, fuzzing::ops);
}

#[test]
fn regressions_header() {
    regressions("header", ffuzz::header_and_extensions);
}

#[test]
fn regressions_l2_slice() {
    regressions("l2_slice", ffuzz::l2_slice);
}

#[test]
fn regressions_refcount_block() {
    regressions("refcount_block", ffuzz::refcount_block);
}

/// Findings in `fuzz/regressions/open_read/` (fixed):
///
/// * `dirty-lazy4k-l2-entry-at-2p55`: the dirty `lazy4k` seed with one L2 entry pointing at
///   host offset 2^55. A writable open rebuilt refcounts (`Inner::rebuild_refcounts`,
///   src/rebuild.rs) for every cluster up to the largest one referenced:
///   `meta::plan_refcount_area` collected one block index per refcount block up to there
///   (2^32 of them) and the allocation failed (the process aborted).
/// * `dirty-l2-entries-at-384g-slow`: a fuzzer-made dirty image with L2 entries near 384 GiB:
///   the same rebuild walked about 50,000 refcount blocks, 2,048 hash lookups each (30 s with
///   the fuzzing instrumentation).
///
/// QEMU's check (which its dirty-image open runs) does not count a reference lying a cluster
/// or more past the end of the file, so its rebuild is bounded by the file size.
#[test]
fn regressions_open_read() {
    regressions("open_read", |d| {
        fuzzing::open_read(d);
        fuzzing::open_write(d);
    });
}

#[test]
fn regressions_ops() {
    regressions("ops", fuzzing::ops);
}

/// Findings in `fuzz/regressions/check/` (fixed):
///
/// * `l1-reserved-bits-repair-quadratic` (a timeout): a 23 KiB image whose active L1 table
///   has 1,376,258 entries at 0x3000; 1,127 of the 1,424 inside the file are 0x4444... or
///   0x3333... (reserved bits set, L2 offset unaligned), the rest read as zeros. `check -r
///   all` repairs them one entry at a time, and each write first ran the overlap check, which
///   scanned the whole active L1 table for L2 tables: 1,127 x 1.4 M entries, 20 s in a debug
///   build and over 30 s under the fuzzing instrumentation (a 32 MiB table of such entries
///   would have taken days). The overlap check now looks ranges up in an index of table
///   starts (`TableStarts` in src/check.rs) kept current as entries are repaired.
/// * `refcount-fix-breaks-copied-flags`: a 48 KiB image whose tables overlap each other and
///   the header; ten clusters had refcount 1 but 4 to 7 references, through entries with
///   COPIED set. `check -r all` fixed the refcounts, which made those COPIED flags wrong, and
///   left them (it never rewrites a table that is also something else): 16,486 corruptions
///   became 16,504 (QEMU's own repair fails on it and leaves 16,492). The repair now leaves
///   alone refcounts whose fix would change what COPIED must say of a cluster that an entry
///   of a shared table names (16,483 after the repair).
/// * `leak-repair-punched-l1-tail`: a 28 KiB image whose active L1 table (64,769 entries at
///   0x3000) runs past the end of the file, so the walk does not count the clusters it
///   occupies inside the file: `check -r all` found three of them leaked, freed them and, as
///   QEMU does, punched them out of the file, zeroing L1 entries. Its final pass, using the L1
///   table read before, reported 23 corruptions where a fresh check found 21. Freed clusters
///   are now punched only where no known metadata lies.
/// * `l1-past-eof-rebuilt-over`: a 4,832-byte image whose two-entry active L1 table is at
///   0x3000, past the end of the file, and whose refcount blocks are missing. `check -r all`
///   rebuilt the refcount structure into the first clusters it thought free, clusters 2 and 3,
///   and so wrote refcount data over the L1 table (not counted as in use because it lies past
///   the end of the file). The L1 entries became garbage (0x1000100010000): a check after the
///   repair found 5 corruptions where there were 3, while the repair's own second pass, still
///   using the L1 table read before the rebuild, reported 4. QEMU's repair of the same image
///   refuses the write ("Preventing invalid write on metadata (overlaps with active L1
///   table)").
/// * `snapshot-l1-past-eof-rebuilt-over`: a 61,583-byte image (fuzz seed 777) whose two
///   snapshots' L1 tables start at offset 0 and run past the end of the file (36,864 and
///   1,048,576 entries), so none of their clusters is counted, and whose refcount block 1
///   lies outside the image. `check -r all` rebuilt the refcount structure into clusters 2
///   and 4, which the snapshots' L1 tables read: the refcounts became L1 entries, and 13,702
///   corruptions became 13,707 (for qimg and qemu-img alike; QEMU's own repair leaves
///   13,726), while the repair reported 13,702. Placing the structure past those clusters
///   instead grows the file over 8 MiB, which brings the L1 tables inside it (then counted:
///   thousands more errors). The rebuild now avoids every uncounted region's clusters inside
///   the file, and is refused, before anything is written, when it would have to grow the
///   file so far that an uncounted region comes within a cluster of its end.
#[test]
fn regressions_check() {
    regressions("check", |d| {
        let _ = fuzzing::check(d);
    });
}

/// `l1-reserved-bits-repair-quadratic` scaled up: 16,384 more L1 entries with reserved bits
/// inside the file. The repair's first (silent) walk, which decides what may be edited, used
/// to rescan the table for every entry it would repair: about 2.4·10^10 comparisons (minutes)
/// where the replay limit allows 20 s. (The repair itself is then refused, as QEMU's is: the
/// L1 table runs past the end of the file.)
#[test]
fn check_repairs_many_l1_entries_without_rescanning_the_table() {
    let name = "l1-reserved-bits-repair-quadratic";
    let mut img = std::fs::read(inputs_dir("regressions", "check").join(name)).unwrap();
    img.resize(img.len().next_multiple_of(8), 0);
    let added = 16_384u64;
    for _ in 0..added {
        img.extend_from_slice(&0x4444_4444_4444_4444u64.to_be_bytes());
    }
    let name = format!("{name} (scaled)");
    replay("check", &[(name.clone(), img)], |d| {
        let [before, _, _] = fuzzing::check(d);
        let before = before.unwrap();
        assert!(before.corruptions >= added, "{name}: {before:?}");
    });
}

/// `qemu-img check --output=json` of `dir/name`: (corruptions, check errors), or `None` when
/// qemu-img cannot check the file at all (no JSON).
fn qemu_check(dir: &Path, name: &str) -> Option<(u64, u64)> {
    let o = common::qemu_img(dir, &["check", "--output=json", name]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
    let n = |f: &str| v.get(f).and_then(|x| x.as_u64()).unwrap_or(0);
    Some((n("corruptions"), n("check-errors")))
}

/// The `check` target's promise measured by the reference: for every committed `check` seed
/// and saved finding (and every file of the directory `QIMG_CHECK_CORPUS` names, e.g. a
/// fuzzer's output corpus), `qemu-img check` after a `qimg check -r all` that completes
/// reports no more corruptions than before, and can still check an image it could check
/// before. A repair that fails part way (as QEMU's does on the same images) marks the image
/// corrupt, as QEMU does, and is only counted: on an image whose L2 table overlaps the header
/// that flag itself reads as an L2 entry with reserved bits.
#[test]
fn check_repairs_never_make_qemu_img_check_worse() {
    qimg_testkit::require_qemu!();
    let mut inputs = seeds("check");
    inputs.extend(fuzzing::inputs("regressions", "check"));
    if let Ok(extra) = std::env::var("QIMG_CHECK_CORPUS") {
        let mut names: Vec<PathBuf> = std::fs::read_dir(&extra)
            .unwrap_or_else(|e| panic!("QIMG_CHECK_CORPUS={extra}: {e}"))
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        names.sort();
        for p in names {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            inputs.push((name, std::fs::read(&p).unwrap()));
        }
    }
    let scratch = common::Scratch::new("fuzz-check-qemu");
    let path = scratch.path("x.qcow2");
    let all = CheckOptions {
        repair: Some(Repair::All),
        ..Default::default()
    };
    let (mut checked, mut improved, mut failed, mut untouched) = (0, 0, 0, 0);
    for (name, data) in &inputs {
        std::fs::write(&path, data).unwrap();
        let Some((before, _)) = qemu_check(&scratch.0, "x.qcow2") else {
            continue;
        };
        let repair = qimg::tools::check::check(&path, &all, &mut |_| {});
        if !repair
            .as_ref()
            .is_ok_and(|r| r.failure.is_none() && r.check_errors == 0)
        {
            failed += 1;
            // A repair refused before it writes anything (a rebuild that would make things
            // worse) must leave the image as it was, for qemu-img too.
            if std::fs::read(&path).unwrap() == *data {
                let after = qemu_check(&scratch.0, "x.qcow2").map(|(c, _)| c);
                assert_eq!(
                    after,
                    Some(before),
                    "{name}: qemu-img check changed on an untouched image ({repair:?})"
                );
                untouched += 1;
            }
            continue;
        }
        let after = qemu_check(&scratch.0, "x.qcow2");
        let Some((after, _)) = after else {
            panic!("{name}: qemu-img can no longer check the image after the repair ({repair:?})");
        };
        assert!(
            after <= before,
            "{name}: qemu-img check finds {after} corruptions after the repair, {before} before \
             ({repair:?})"
        );
        checked += 1;
        improved += u64::from(after < before);
    }
    println!(
        "{} inputs, {checked} checkable by qemu-img and repaired, {improved} with fewer \
         corruptions after qimg check -r all, none with more; {failed} repairs failed part way \
         ({untouched} of them refused before writing anything)",
        inputs.len()
    );
    assert!(
        checked >= 15,
        "only {checked} inputs could be checked by qemu-img"
    );
}
