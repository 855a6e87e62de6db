//! The sources of `qimg convert`, read end to end as one guest view.

use std::sync::Arc;

use std::path::Path;

use anyhow::{Result, anyhow};
use qimg::chain::ImageFormat;
use qimg::io::{AnyStorage, Backend, Storage};
use qimg::{Image, OpenOptions};

use super::plan::SourceChain;
use super::refuse_overwriting_source;
use crate::cache_mode::CacheMode;
use crate::chain::open_chain;
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
            SourceImage::Qcow2(img) => img.read(buf, offset).await.map_err(|e| anyhow!("{e}")),
            SourceImage::Raw(f) => f
                .read_at_zero_fill(buf, offset)
                .await
                .map_err(|e| anyhow!("{e}")),
        }
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
}

/// Opens every source (`(file, format)`), for its block status and for reading, refusing one
/// whose chain holds the output `dst_path`; returns the chains, the reader over all of them
/// and their total size.
pub(super) async fn open_sources(
    sources: &[(String, ImageFormat)],
    dst_path: &Path,
    dst_file: &str,
    src_cache: CacheMode,
    force_share: bool,
) -> Result<(Vec<SourceChain>, Source, u64)> {
    let mut srcs = Vec::new();
    let mut readers = Vec::new();
    let mut size = 0u64;
    for (file, fmt) in sources {
        let path = Path::new(file);
        let layers = open_chain(path, file, *fmt, force_share).await?;
        refuse_overwriting_source(&layers, dst_path, dst_file)?;
        let src_size = layers[0].size();
        let reader = match fmt {
            ImageFormat::Qcow2 => {
                let o = OpenOptions::new()
                    .direct(src_cache.direct)
                    .clean_timer(false)
                    .force_share(force_share);
                SourceImage::Qcow2(
                    o.open(path)
                        .await
                        .map_err(|e| anyhow!("Could not open '{file}': {}", lib_msg(&e, file)))?,
                )
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
