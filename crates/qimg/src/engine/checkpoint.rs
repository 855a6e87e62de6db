//! Transactions: several snapshot and bitmap changes at one instant between two guest
//! requests ([`Image::transaction`]), the checkpoint of an incremental backup.

use qimg_io::Storage;

use crate::engine::image::Image;
use crate::engine::snapshot::{InternalSnapshot, SnapshotOptions};
use crate::error::{Error, Result};

/// One change of a [`Image::transaction`]; the names are QMP's transaction actions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// An internal snapshot of the disk as it is (`blockdev-snapshot-internal-sync`): the
    /// frozen view of a checkpoint.
    Snapshot {
        /// Its name (another snapshot of that name is refused, as QEMU refuses it).
        name: String,
        /// Its date and guest clock.
        options: SnapshotOptions,
    },
    /// A new empty persistent bitmap (`block-dirty-bitmap-add`).
    AddBitmap {
        /// Its name.
        name: String,
        /// Bytes per bit (a power of two); the cluster size within 4 to 64 KiB by default.
        granularity: Option<u64>,
        /// Records writes from now on (QMP's `disabled: false`).
        enabled: bool,
    },
    /// Removes a bitmap (`block-dirty-bitmap-remove`).
    RemoveBitmap {
        /// Its name.
        name: String,
    },
    /// Clears every bit (`block-dirty-bitmap-clear`).
    ClearBitmap {
        /// Its name.
        name: String,
    },
    /// Starts (`block-dirty-bitmap-enable`) or stops (`-disable`) recording writes.
    EnableBitmap {
        /// Its name.
        name: String,
        /// Record writes from now on.
        enabled: bool,
    },
    /// Sets in `target` every bit set in one of `sources` (`block-dirty-bitmap-merge`).
    MergeBitmaps {
        /// The bitmap that gains bits.
        target: String,
        /// Bitmaps of this image.
        sources: Vec<String>,
    },
}

/// The body of [`Image::transaction`].
pub(crate) async fn transaction<S: Storage + 'static>(
    img: &Image<S>,
    actions: &[Action],
) -> Result<Vec<InternalSnapshot>> {
    let inner = &*img.inner;
    let mut names: Vec<String> = img.snapshots().await?.into_iter().map(|s| s.name).collect();
    for a in actions {
        if let Action::Snapshot { name, .. } = a {
            inner.check_new_snapshot(name)?;
            if names.contains(name) {
                return Err(Error::InvalidOption(format!(
                    "Snapshot with name '{name}' already exists"
                )));
            }
            names.push(name.clone());
        }
    }
    inner.check_bitmap_actions(actions)?;
    // Every range: no request runs while the actions apply (a request that recorded
    // itself in the bitmaps before and runs after records itself again, see
    // `Inner::recorded`).
    let _guard = inner.locks.lock(0, u64::MAX, true).await;
    // Sources of merges as they are at this instant.
    let mut merged = Vec::new();
    for a in actions {
        if let Action::MergeBitmaps { sources, .. } = a {
            for s in sources {
                merged.push(img.dirty_bitmap(s).await?);
            }
        }
    }
    let mut made = Vec::new();
    for a in actions {
        if let Action::Snapshot { name, options } = a {
            made.push(super::snapshot::create_snapshot_locked(img, name, options).await?);
        }
    }
    let bitmaps_changed = actions
        .iter()
        .any(|a| !matches!(a, Action::Snapshot { .. }));
    let mut merged = merged.into_iter();
    for a in actions {
        match a {
            Action::Snapshot { .. } => {}
            Action::AddBitmap {
                name,
                granularity,
                enabled,
            } => inner.add_bitmap(name, *granularity, *enabled)?,
            Action::RemoveBitmap { name } => inner.remove_bitmap(name)?,
            Action::ClearBitmap { name } => inner.clear_bitmap(name)?,
            Action::EnableBitmap { name, enabled } => inner.enable_bitmap(name, *enabled)?,
            Action::MergeBitmaps { target, sources } => {
                for _ in sources {
                    if let Some(source) = merged.next() {
                        inner.merge_bitmap(target, &source)?;
                    }
                }
            }
        }
    }
    if bitmaps_changed {
        // On disk before the transaction returns: a crash from here on finds the new
        // bitmaps recording and the disabled ones with their final bits.
        inner.persist_bitmaps().await?;
    }
    Ok(made)
}
