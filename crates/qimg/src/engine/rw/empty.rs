//! Emptying an image ([`Image::make_empty`]): what `qemu-img commit` does to the top image
//! after copying its data down, so that reads fall through to the backing file again.

use qimg_io::Storage;

use super::super::image::Image;
use super::super::map::ExtentKind;
use crate::error::Result;

impl<S: Storage + 'static> Image<S> {
    /// Makes every cluster of the image unallocated: reads then come from the backing file
    /// (or are zeros without one). Data, zero and compressed clusters alike are dropped and
    /// their host clusters freed. Where QEMU's `qcow2_make_empty` resets the whole image
    /// (version 3, no snapshots, bitmaps or data file) so does this, leaving the same four
    /// clusters; otherwise only ranges the image allocates are visited.
    pub async fn make_empty(&self) -> Result<()> {
        self.inner.shared.check_writable()?;
        {
            let _all = self.inner.locks.lock(0, u64::MAX, true).await;
            let mut m = self.inner.meta.lock().await;
            self.inner.ensure_open(&m)?;
            if self.inner.shared.empty_completely(&mut m).await? {
                return Ok(());
            }
        }
        let size = self.size();
        if size == 0 {
            return Ok(());
        }
        let extents = self.map(0, size).await?;
        let mut pending: Option<(u64, u64)> = None;
        for e in extents {
            if let ExtentKind::Unallocated { .. } = e.kind {
                continue;
            }
            pending = match pending {
                Some((s, l)) if s + l == e.start => Some((s, l + e.length)),
                Some((s, l)) => {
                    self.discard_whole(s, l, size).await?;
                    Some((e.start, e.length))
                }
                None => Some((e.start, e.length)),
            };
        }
        if let Some((s, l)) = pending {
            self.discard_whole(s, l, size).await?;
        }
        self.flush().await
    }

    /// Discards `[start, start + len)` widened to whole clusters (within the disk), so that
    /// nothing smaller than a subcluster is left behind.
    async fn discard_whole(&self, start: u64, len: u64, size: u64) -> Result<()> {
        let cs = self.cluster_size();
        let a = start - start % cs;
        let b = (start + len).next_multiple_of(cs).min(size);
        self.inner.unallocate(a, b - a).await
    }
}
