//! Compressed writes (`qimg convert -c`): whole clusters compressed and packed into host
//! clusters as QEMU packs them.

use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    /// Stores one whole guest cluster compressed (the last cluster of a disk whose size is not
    /// a multiple of the cluster size may be shorter). Data that does not shrink is written
    /// the ordinary way, as QEMU does.
    pub(crate) async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.shared.check_writable()?;
        let cs = self.shared.geo.cluster_size();
        let len = data.len() as u64;
        self.shared.check_range(offset, len)?;
        self.shared.check_not_encrypted("a compressed write")?;
        if self.shared.data_file.is_some() {
            return Err(Error::Unsupported {
                path: self.shared.path.clone(),
                what: "compressed clusters in an image with an external data file".into(),
            });
        }
        let whole = len == cs || (len > 0 && len < cs && offset + len == self.shared.size());
        if offset % cs != 0 || !whole {
            return Err(Error::InvalidOption(format!(
                "{}: a compressed write must cover one whole cluster ({cs} bytes at a cluster \
                 boundary, or the disk's last partial cluster), not {len} bytes at {offset:#x}",
                self.shared.path.display()
            )));
        }
        let recorded = self.record_change(offset, len).await?;
        let mut padded;
        let input = if len == cs {
            data
        } else {
            padded = vec![0u8; cs as usize];
            padded[..data.len()].copy_from_slice(data);
            &padded[..]
        };
        let cbits = self.shared.geo.cluster_bits();
        let Some(packed) = compress::compress(self.shared.compression, input, cs as usize - 1)
            .filter(|p| CompressedDescriptor::new(0, p.len() as u64, cbits).is_ok())
        else {
            return self.write(data, offset).await;
        };
        let plen = packed.len() as u64;
        let _guard = self.locks.lock(offset / cs, offset / cs + 1, true).await;
        self.recorded(recorded, offset, len).await?;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        let old = self.shared.lookup(&mut m, offset).await?;
        self.table_before_data(&mut m, offset).await?;
        // Pack into the tail of the last compressed cluster when the bytes fit there.
        let at = match m.compressed_tail() {
            Some(t) if t % cs + plen <= cs => {
                self.shared.update_refcount(&mut m, t / cs, 1).await?;
                t
            }
            _ => {
                let h = self.shared.alloc_clusters(&mut m, 1).await?;
                self.shared
                    .counters
                    .clusters_allocated
                    .fetch_add(1, Ordering::Relaxed);
                h
            }
        };
        let end = at + plen;
        m.set_compressed_tail((end % cs != 0).then_some(end));
        let desc =
            CompressedDescriptor::new(at, plen, cbits).map_err(|e| self.shared.fmt_err(e))?;
        self.shared
            .guard_write(&mut m, at, plen, Writing::Data)
            .await?;
        drop(m);

        self.shared
            .file
            .debug_event(qimg_io::DebugEvent::WriteCompressed);
        let written = self
            .shared
            .file
            .write_at(&packed, at)
            .await
            .map_err(|e| self.shared.storage_error(e));
        let mut m = self.meta.lock().await;
        if let Err(e) = written {
            let _ = self.shared.free_clusters(&mut m, at - at % cs, 1).await;
            return Err(e);
        }
        self.shared
            .set_dependency(&mut m, CacheKind::L2, CacheKind::Refcount)
            .await?;
        let entry = L2Entry::Compressed(desc);
        let new = match old {
            AnyL2Entry::Standard(_) => AnyL2Entry::Standard(entry),
            AnyL2Entry::Extended(_) => AnyL2Entry::Extended(ExtendedL2Entry {
                entry,
                bitmap: SubclusterBitmap { alloc: 0, zero: 0 },
            }),
        };
        self.shared.set_entry(&mut m, offset, &new).await?;
        m.entries_wait_for_data();
        if let Some(freed) = old_reference(old.entry()) {
            self.release(&mut m, freed).await?;
        }
        Ok(())
    }
}
