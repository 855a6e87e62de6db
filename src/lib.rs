//! qimg: qcow2 images with subcluster allocation.
pub use qimg_format as format;
