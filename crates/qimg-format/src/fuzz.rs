//! Entry points shared by the cargo-fuzz targets in `fuzz/` and by `cargo test`, which
//! replays the committed seed corpus through them. Each one must never panic on any input;
//! a panic is a finding.

use crate::extensions::Cluster0;
use crate::header::Header;
use crate::validate::{OpenMode, validate_cluster0};

/// Decodes `data` as the start of an image: header, extensions, backing name, with QEMU's
/// open-time validation in every mode. Whatever decodes must encode and decode back to the
/// same value.
pub fn header_and_extensions(data: &[u8]) {
    if let Ok(h) = Header::decode(data) {
        if let Ok(bytes) = h.encode() {
            let back = Header::decode(&bytes).expect("an encoded header decodes");
            assert_eq!(back, h, "header round trip");
        }
    }
    let mut decoded = None;
    for mode in [OpenMode::ReadOnly, OpenMode::ReadWrite, OpenMode::Check] {
        if let Ok(c) = validate_cluster0(data, mode) {
            decoded = Some(c);
        }
    }
    let Some(c) = decoded.or_else(|| Cluster0::decode(data).ok()) else {
        return;
    };
    let mut again = c.clone();
    if let Ok(bytes) = again.encode() {
        let mut cluster = bytes;
        if let Some(cs) = again.header.cluster_size() {
            if cs <= 2 << 20 {
                cluster.resize(cs as usize, 0);
            }
        }
        let back = Cluster0::decode(&cluster).expect("an encoded cluster 0 decodes");
        assert_eq!(back.header, again.header, "cluster 0 header round trip");
        assert_eq!(back.extensions, again.extensions, "extension round trip");
        assert_eq!(
            back.backing_file, again.backing_file,
            "backing name round trip"
        );
    }
}
