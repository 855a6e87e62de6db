//! `qimg convert -C`: copy offloading, as qemu-img's `-C`. Data ranges go from the file that
//! holds them to a raw output with `copy_file_range`: the kernel copies (or, on a file system
//! that shares blocks, clones) them without passing the bytes through user space. What cannot
//! go that way (compressed clusters, data read from a backing file, a qcow2 output, a file
//! system or cache mode the call refuses) is read and written as without `-C`. As in
//! qemu-img, `-C` copies data ranges whole: no zero detection (`-S`) inside them.

use std::os::fd::OwnedFd;

use anyhow::{Context, Result, anyhow};
use nix::errno::Errno;
use qimg::ExtentKind;
use qimg::io::Storage;

use super::source::{Source, SourceImage};
use super::target::ConvertOutput;

/// Bytes handed to one `copy_file_range` call.
const STEP: usize = 1 << 20;

/// Copies guest bytes `[s, e)` of `src` to `dst`, offloaded where the bytes lie in a file;
/// returns the bytes that went through `copy_file_range`.
pub(super) async fn copy_range(src: &Source, dst: &ConvertOutput, s: u64, e: u64) -> Result<u64> {
    let Some(out) = dst.raw_fd() else {
        copy_through(src, dst, s, e).await?;
        return Ok(0);
    };
    let mut offloaded = 0;
    for (start, size, image) in src.0.iter() {
        let (from, to) = (s.max(*start), e.min(start + size));
        if from >= to {
            continue;
        }
        // (guest offset, host offset, length) of what lies in the file `file`.
        let (file, pieces): (OwnedFd, Vec<(u64, u64, u64)>) = match image {
            SourceImage::Raw(storage) => {
                let Some(fd) = storage
                    .direct_access()
                    .and_then(|a| a.fd.try_clone_to_owned().ok())
                else {
                    copy_through(src, dst, from, to).await?;
                    continue;
                };
                (fd, vec![(from, from - start, to - from)])
            }
            SourceImage::Qcow2(img) => {
                let lease = img
                    .read_lease(from - start, to - from)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
                let file = std::fs::File::open(img.data_path()).with_context(|| {
                    format!("cannot open '{}' to copy from", img.data_path().display())
                })?;
                let mut pieces = Vec::new();
                for x in lease.extents() {
                    let guest = start + x.start;
                    match x.kind {
                        ExtentKind::Data { host_offset } => {
                            pieces.push((guest, host_offset, x.length));
                        }
                        // Zeros, backing data, compressed clusters: through the engine.
                        _ => copy_through(src, dst, guest, guest + x.length).await?,
                    }
                }
                // The lease keeps the clusters where the extents say until they are copied.
                let copied = offload_pieces(src, dst, &file.into(), &out, &pieces).await?;
                drop(lease);
                offloaded += copied;
                continue;
            }
        };
        offloaded += offload_pieces(src, dst, &file, &out, &pieces).await?;
    }
    dst.written().await?;
    Ok(offloaded)
}

/// Offloads each `(guest, host, len)` piece from `file` to the output `out`; what the kernel
/// refuses is copied through user space. Returns the bytes offloaded.
async fn offload_pieces(
    src: &Source,
    dst: &ConvertOutput,
    file: &OwnedFd,
    out: &OwnedFd,
    pieces: &[(u64, u64, u64)],
) -> Result<u64> {
    let mut offloaded = 0;
    for &(guest, host, len) in pieces {
        let (fin, fout) = (file.try_clone()?, out.try_clone()?);
        let done = tokio::task::spawn_blocking(move || offload(&fin, host, &fout, guest, len))
            .await
            .map_err(|e| anyhow!("a copy offload task failed: {e}"))?
            .with_context(|| format!("error while writing at byte {guest}"))?;
        offloaded += done;
        dst.wrote(guest, done).await;
        if done < len {
            copy_through(src, dst, guest + done, guest + len).await?;
        }
    }
    Ok(offloaded)
}

/// `copy_file_range` of `len` bytes from `host` in `fin` to `guest` in `fout`, until done or
/// refused; returns the bytes copied. Refusals (no support across these files, this file
/// system or this cache mode; the source file ending early) stop it without an error.
fn offload(fin: &OwnedFd, host: u64, fout: &OwnedFd, guest: u64, len: u64) -> Result<u64> {
    let (mut off_in, mut off_out) = (i64::try_from(host)?, i64::try_from(guest)?);
    let mut done = 0u64;
    while done < len {
        let n = ((len - done) as usize).min(STEP);
        match nix::fcntl::copy_file_range(fin, Some(&mut off_in), fout, Some(&mut off_out), n) {
            Ok(0) => break,
            Ok(k) => done += k as u64,
            Err(Errno::EINTR) => {}
            Err(
                Errno::EXDEV | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP | Errno::EBADF,
            ) => break,
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
    }
    Ok(done)
}

/// Copies guest bytes `[s, e)` by reading and writing, in pieces of at most 2 MiB.
async fn copy_through(src: &Source, dst: &ConvertOutput, s: u64, e: u64) -> Result<()> {
    let mut at = s;
    while at < e {
        let n = (e - at).min(2 << 20);
        let mut buf = vec![0u8; n as usize];
        src.read_salvaging(&mut buf, at, false, false, &[]).await?;
        dst.write(&buf, at)
            .await
            .with_context(|| format!("error while writing at byte {at}"))?;
        at += n;
    }
    Ok(())
}
