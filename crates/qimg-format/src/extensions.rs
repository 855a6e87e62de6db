//! The path header extensions had before the aggregate of cluster 0 moved out of their module:
//! [`crate::extension`] (one [`Extension`] and the extension area) and
//! [`crate::cluster0::Cluster0`], re-exported so that existing imports keep working. New code
//! imports from those modules; nothing inside this crate uses this one.

pub use crate::cluster0::Cluster0;
pub use crate::extension::*;
