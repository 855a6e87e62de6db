//! The sources of `qimg convert`, read end to end as one guest view.

use std::sync::Arc;

use std::path::Path;

use anyhow::{Result, anyhow, bail};
use qimg::Image;
use qimg::chain::ImageFormat;
use qimg::io::{AnyStorage, Backend, Storage};

use super::plan::SourceChain;
use super::refuse_overwriting_source;
use crate::cache_mode::CacheMode;
use crate::chain::{Layer, open_chain};
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
                .map_err(|e| anyhow!("{}", read_error_words(&e, e.os_error()))),
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
    /// warning unless `quiet`, as qemu-img's `--salvage`.
    pub(super) async fn read_salvaging(
        &self,
        buf: &mut [u8],
        offset: u64,
        salvage: bool,
        quiet: bool,
    ) -> Result<()> {
        let whole = self.read(buf, offset).await;
        let Err(e) = whole else { return Ok(()) };
        if !salvage {
            return Err(e.context(format!("error while reading at byte {offset}")));
        }
        for (i, sector) in buf.chunks_mut(512).enumerate() {
            let at = offset + (i * 512) as u64;
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

/// `-l`: the top image shows the snapshot, for its block status too (whose shortcut over
/// empty L1 entries, read from the file's active table, no longer applies).
async fn view_snapshot(
    layers: &mut [Layer],
    (id, name): &(Option<String>, Option<String>),
) -> Result<()> {
    match layers.first_mut() {
        Some(Layer::Qcow2 {
            img, l2_presence, ..
        }) => {
            load_snapshot(img, id, name).await?;
            *l2_presence = None;
            Ok(())
        }
        _ => bail!("Failed to load snapshot: raw images have no snapshots"),
    }
}

/// Shows snapshot `id`/`name` in place of `img`'s disk, in qemu-img's words when there is none.
async fn load_snapshot(
    img: &Image<AnyStorage>,
    id: &Option<String>,
    name: &Option<String>,
) -> Result<()> {
    match img.view_snapshot(id.as_deref(), name.as_deref()).await {
        Ok(()) => Ok(()),
        Err(qimg::Error::SnapshotNotFound { .. }) => {
            bail!("Failed to load snapshot: Can't find snapshot")
        }
        Err(e) => bail!("Failed to load snapshot: {e}"),
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
        let mut layers = open_chain(path, file, *fmt, force_share).await?;
        refuse_overwriting_source(&layers, dst_path, dst_file, creating)?;
        if let Some(sn) = snapshot {
            view_snapshot(&mut layers, sn).await?;
        }
        let src_size = layers[0].size();
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
