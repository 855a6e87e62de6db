//! The sources of `qimg convert`, read end to end as one guest view.

use std::sync::Arc;

use std::path::Path;

use anyhow::{Result, anyhow};
use qimg::Image;
use qimg::chain::ImageFormat;
use qimg::io::{AnyStorage, Backend, Storage};

use super::plan::SourceChain;
use super::refuse_overwriting_source;
use crate::cache_mode::CacheMode;
use crate::chain::{load_snapshot, open_chain, view_snapshot};
use crate::status::lib_msg;

/// One source image, read through its whole chain.
#[derive(Clone)]
pub(super) enum SourceImage {
    Qcow2(Image<AnyStorage>),
    Raw(Arc<AnyStorage>),
}

impl SourceImage {
    pub(super) async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            SourceImage::Qcow2(img) => img
                .read(buf, offset)
                .await
                // Damage reads as EIO, as qemu-img says it.
                .map_err(|e| anyhow!("{}", read_error_words(&e, Some(e.errno())))),
            SourceImage::Raw(f) => f
                .read_at_zero_fill(buf, offset)
                .await
                .map_err(|e| anyhow!("{}", read_error_words(&e, e.raw_os_error()))),
        }
    }
}

/// A failed read in the words of the tool qimg speaks as: qemu-img names only the OS error
/// (`Input/output error`), qimg the request too.
fn read_error_words(e: &dyn std::fmt::Display, errno: Option<i32>) -> String {
    match errno {
        Some(n) if crate::status::program() != "qimg" => {
            crate::status::os_msg(&std::io::Error::from_raw_os_error(n))
        }
        _ => e.to_string(),
    }
}

/// Where the guest data is read from: the sources end to end (`(start, size, reader)` each,
/// `start` being where the source begins in the output).
#[derive(Clone)]
pub(super) struct Source(pub(super) Arc<Vec<(u64, u64, SourceImage)>>);

impl Source {
    pub(super) async fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset + buf.len() as u64;
        for (start, size, r) in self.0.iter() {
            let s = offset.max(*start);
            let e = end.min(start + size);
            if s < e {
                let part = &mut buf[(s - offset) as usize..(e - offset) as usize];
                r.read(part, s - start).await?;
            }
        }
        Ok(())
    }

    /// Reads as [`read`](Self::read); with `--salvage` (`salvage`) a failed read is read
    /// again sector by sector and the sectors that still fail read as zeros, each with a
    /// warning unless `quiet`, as qemu-img's `--salvage`. `status_failed`: the sectors in
    /// the range whose block status could not be read, each
    /// warned of again before it is read, as qemu-img's copy pass asks their status again.
    pub(super) async fn read_salvaging(
        &self,
        buf: &mut [u8],
        offset: u64,
        salvage: bool,
        quiet: bool,
        status_failed: &[super::plan::StatusFailed],
    ) -> Result<()> {
        let warn_status = |at: u64| {
            if let Some(f) = status_failed.iter().find(|f| f.output == at) {
                if !quiet {
                    eprintln!(
                        "{}: warning: error while reading block status at offset {}: {}",
                        crate::status::program(),
                        f.source,
                        f.why
                    );
                }
            }
        };
        let whole = self.read(buf, offset).await;
        let Err(e) = whole else {
            for f in status_failed {
                warn_status(f.output);
            }
            return Ok(());
        };
        if !salvage {
            return Err(e.context(format!("error while reading at byte {offset}")));
        }
        for (i, sector) in buf.chunks_mut(512).enumerate() {
            let at = offset + (i * 512) as u64;
            warn_status(at);
            if let Err(e) = self.read(sector, at).await {
                if !quiet {
                    eprintln!(
                        "{}: warning: error while reading offset {at}: {e}",
                        crate::status::program()
                    );
                }
                sector.fill(0);
            }
        }
        Ok(())
    }
}

/// Opens every source (`(file, format)`), for its block status and for reading, refusing one
/// whose chain holds the output (`dst_path`, named `dst_file`, created as format `creating`
/// unless `-n`); returns the chains, the reader over all of them
/// and their total size.
pub(super) async fn open_sources(
    sources: &[(String, ImageFormat)],
    (dst_path, dst_file, creating): (&Path, &str, Option<&str>),
    src_cache: CacheMode,
    force_share: bool,
    snapshot: Option<&(Option<String>, Option<String>)>,
) -> Result<(Vec<SourceChain>, Source, u64)> {
    let mut srcs = Vec::new();
    let mut readers = Vec::new();
    let mut size = 0u64;
    for (file, fmt) in sources {
        let path = Path::new(file);
        let layers = open_chain(path, file, *fmt, force_share).await?;
        refuse_overwriting_source(&layers, dst_path, dst_file, creating)?;
        if let Some(sn) = snapshot {
            view_snapshot(&layers, sn).await?;
        }
        let src_size = layers.size();
        let reader = match fmt {
            ImageFormat::Qcow2 => {
                let o = crate::image_spec::options_for(path)
                    .direct(src_cache.direct)
                    .clean_timer(false)
                    .force_share(force_share);
                let img = o
                    .open(path)
                    .await
                    .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?;
                if let Some((id, name)) = snapshot {
                    load_snapshot(&img, id, name).await?;
                }
                SourceImage::Qcow2(img)
            }
            ImageFormat::Raw => SourceImage::Raw(Arc::new(
                AnyStorage::open(path, false, Backend::Threads, src_cache.direct)
                    .map_err(|e| anyhow!("Could not open '{file}': {e}"))?,
            )),
        };
        readers.push((size, src_size, reader));
        srcs.push(SourceChain {
            layers,
            start: size,
            size: src_size,
        });
        size = size
            .checked_add(src_size)
            .ok_or_else(|| anyhow!("the sources add up to more than 16 EiB"))?;
    }
    Ok((srcs, Source(Arc::new(readers)), size))
}
