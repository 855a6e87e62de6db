//! Emptying an image ([`Image::make_empty`]): what `qemu-img commit` does to the top image
//! after copying its data down, so that reads fall through to the backing file again.

use qimg_io::Storage;

use super::super::image::Image;
use super::super::map::ExtentKind;
use crate::error::Result;

/// The body of [`Image::make_empty`].
pub(crate) async fn make_empty<S: Storage + 'static>(img: &Image<S>) -> Result<()> {
    img.inner.shared.check_writable()?;
    {
        let _all = img.inner.locks.lock(0, u64::MAX, true).await;
        let mut m = img.inner.meta.lock().await;
        img.inner.ensure_open(&m)?;
        if img.inner.shared.empty_completely(&mut m).await? {
            return Ok(());
        }
    }
    let size = img.size();
    if size == 0 {
        return Ok(());
    }
    let extents = img.map(0, size).await?;
    let mut pending: Option<(u64, u64)> = None;
    for e in extents {
        if let ExtentKind::Unallocated { .. } = e.kind {
            continue;
        }
        pending = match pending {
            Some((s, l)) if s + l == e.start => Some((s, l + e.length)),
            Some((s, l)) => {
                discard_whole(img, s, l, size).await?;
                Some((e.start, e.length))
            }
            None => Some((e.start, e.length)),
        };
    }
    if let Some((s, l)) = pending {
        discard_whole(img, s, l, size).await?;
    }
    img.flush().await
}

/// Discards `[start, start + len)` widened to whole clusters (within the disk), so that
/// nothing smaller than a subcluster is left behind.
async fn discard_whole<S: Storage + 'static>(
    img: &Image<S>,
    start: u64,
    len: u64,
    size: u64,
) -> Result<()> {
    let cs = img.cluster_size();
    let a = start - start % cs;
    let b = (start + len).next_multiple_of(cs).min(size);
    img.inner.unallocate(a, b - a).await
}
