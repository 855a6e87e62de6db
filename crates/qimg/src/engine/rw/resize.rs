//! Resizing the virtual disk.

use qimg_format::header;
use qimg_io::Storage;

use super::*;

impl<S: Storage> Inner<S> {
    pub(crate) async fn resize(&self, new_size: u64) -> Result<()> {
        self.check_writable()?;
        let size = self.size();
        if new_size < size {
            return Err(Error::Unsupported {
                path: self.path.clone(),
                what: format!("shrinking from {size} to {new_size} bytes"),
            });
        }
        if new_size == size {
            return Ok(());
        }
        let entries = self
            .geo
            .l1_size_for(new_size)
            .map_err(|e| Error::InvalidOption(format!("size {new_size}: {e}")))?;
        let _guard = self.locks.lock(0, u64::MAX, true).await;
        let mut m = self.meta.lock().await;
        self.ensure_open(&m)?;
        self.grow_l1(&mut m, entries).await?;
        if self.data_file_raw {
            let (storage, path) = self.data();
            let len = storage.len().await.map_err(|e| Error::storage(path, e))?;
            if len < new_size {
                storage
                    .set_len(new_size)
                    .await
                    .map_err(|e| Error::storage(path, e))?;
            }
        }
        self.file
            .write_at(&header::encode_size(new_size), header::field::SIZE)
            .await
            .map_err(|e| self.storage_error(e))?;
        self.file.flush().await.map_err(|e| self.storage_error(e))?;
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }
}
