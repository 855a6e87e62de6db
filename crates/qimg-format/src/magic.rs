//! Magic numbers of the header extensions (qcow2-format.md section 2), apart from the modules
//! that decode the extensions so that every module can name them without importing another.

/// End of the extension area.
pub const EXT_END: u32 = 0x0000_0000;
/// Backing file format name.
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Feature name table.
pub const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
/// Bitmaps.
pub const EXT_BITMAPS: u32 = 0x2385_2875;
/// Full disk encryption header pointer.
pub const EXT_CRYPTO: u32 = 0x0537_be77;
/// External data file name ("DATA").
pub const EXT_DATA_FILE: u32 = 0x4441_5441;
