//! The VM-state area of internal snapshots (qemu-io's `read -b` / `write -b`, QEMU's
//! `bdrv_save_vmstate`): guest offsets past the disk, from the first L1 entry the disk does
//! not use. Saved VM state is stored there as guest data is, cluster by cluster.

use std::io::{IoSlice, IoSliceMut};

use qimg_io::{DebugEvent, Storage};

use super::super::image::Inner;
use crate::error::{Error, Result};

impl<S: Storage> Inner<S> {
    /// The guest offset where the VM-state area starts: the disk size rounded up to what one
    /// L2 table maps (QEMU's `qcow2_vm_state_offset`).
    pub(crate) fn vm_state_offset(&self) -> u64 {
        let per_table = self.shared.geo.cluster_size() * self.shared.geo.l2_entries();
        self.shared.size().div_ceil(per_table) * per_table
    }

    /// The guest offset of `len` bytes at `pos` in the VM-state area, refused past what an L1
    /// table can map.
    fn vm_state_range(&self, pos: u64, len: u64) -> Result<u64> {
        let per_table = self.shared.geo.cluster_size() * self.shared.geo.l2_entries();
        let limit = (qimg_format::validate::MAX_L1_BYTES / 8).saturating_mul(per_table);
        let offset = self.vm_state_offset().checked_add(pos);
        match offset {
            Some(o) if o.checked_add(len).is_some_and(|end| end <= limit) => Ok(o),
            _ => Err(Error::OutOfRange {
                path: self.shared.path.clone(),
                offset: pos,
                len,
                size: limit.saturating_sub(self.vm_state_offset()),
            }),
        }
    }

    /// Reads `buf` from position `pos` of the VM-state area (zeros where nothing was saved).
    pub(crate) async fn read_vmstate(&self, buf: &mut [u8], pos: u64) -> Result<()> {
        let len = buf.len() as u64;
        let offset = self.vm_state_range(pos, len)?;
        self.shared.file.debug_event(DebugEvent::VmstateLoad);
        self.read_span(&mut [IoSliceMut::new(buf)], offset, len)
            .await
    }

    /// Writes `buf` at position `pos` of the VM-state area, growing the L1 table to map it.
    /// Dirty bitmaps do not track the area (it is no guest data).
    pub(crate) async fn write_vmstate(&self, buf: &[u8], pos: u64) -> Result<()> {
        self.shared.check_writable()?;
        let len = buf.len() as u64;
        let offset = self.vm_state_range(pos, len)?;
        if len == 0 {
            return Ok(());
        }
        let (first, end) = self.cluster_span(offset, len);
        let _guard = self.locks.lock(first, end, true).await;
        {
            let per_table = self.shared.geo.cluster_size() * self.shared.geo.l2_entries();
            let mut m = self.meta.lock().await;
            self.ensure_open(&m)?;
            self.shared
                .grow_l1(&mut m, (offset + len).div_ceil(per_table))
                .await?;
        }
        self.shared.file.debug_event(DebugEvent::VmstateSave);
        self.write_locked(&[IoSlice::new(buf)], offset, len).await
    }
}
