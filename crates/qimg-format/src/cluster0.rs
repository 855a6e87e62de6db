//! [`Cluster0`]: everything stored in cluster 0 (header, header extensions, backing file name),
//! decoded and encoded as one aggregate. It sits above `header`, `extensions`, `features` and
//! `bitmap`, which do not import it, so the format modules form no cycle.

use crate::be::pad8;
use crate::bitmap::BitmapsExtension;
use crate::error::{FormatError, Result};
use crate::extensions::{Extension, MAX_BACKING_NAME, decode_backing_name, decode_extensions};
use crate::features::FeatureName;
use crate::header::Header;

/// Everything stored in cluster 0: header, extensions and backing file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster0 {
    /// The header.
    pub header: Header,
    /// Extensions in the order they were found (or are to be written).
    pub extensions: Vec<Extension>,
    /// Backing file name (raw bytes, not NUL-terminated), if any.
    pub backing_file: Option<Vec<u8>>,
}

impl Cluster0 {
    /// Decodes header, extensions and backing file name from `bytes`, the start of the file
    /// (normally all of cluster 0; fewer bytes are fine when the file is shorter).
    ///
    /// Extension parsing follows QEMU: it runs from `header_length` up to the backing file name
    /// (or the end of cluster 0) and stops at an end marker. An extension running past the area,
    /// a duplicate known extension, or a backing name that does not fit in cluster 0 is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let header = Header::decode(bytes)?;
        let cluster_size = header.cluster_size().ok_or(FormatError::InvalidField {
            what: "cluster_bits",
            offset: 20,
            value: u64::from(header.cluster_bits),
            reason: "a cluster size must fit in 64 bits".into(),
        })?;
        let extensions = decode_extensions(bytes, &header, cluster_size)?;
        let backing_file = decode_backing_name(bytes, &header, cluster_size)?;
        Ok(Self {
            header,
            extensions,
            backing_file,
        })
    }

    /// The backing format name, if the extension is present.
    pub fn backing_format(&self) -> Option<&[u8]> {
        self.extensions.iter().find_map(|e| match e {
            Extension::BackingFormat(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The external data file name, if the extension is present.
    pub fn data_file(&self) -> Option<&[u8]> {
        self.extensions.iter().find_map(|e| match e {
            Extension::DataFile(f) => Some(f.as_slice()),
            _ => None,
        })
    }

    /// The feature name table (empty when absent).
    pub fn feature_table(&self) -> &[FeatureName] {
        self.extensions
            .iter()
            .find_map(|e| match e {
                Extension::FeatureTable(t) => Some(t.as_slice()),
                _ => None,
            })
            .unwrap_or(&[])
    }

    /// The bitmaps extension, if present.
    pub fn bitmaps(&self) -> Option<&BitmapsExtension> {
        self.extensions.iter().find_map(|e| match e {
            Extension::Bitmaps(b) => Some(b),
            _ => None,
        })
    }

    /// Sorts the extensions into the order QEMU writes them (stable among unknown ones).
    pub fn sort_like_qemu(&mut self) {
        self.extensions.sort_by_key(Extension::qemu_rank);
    }

    /// Encodes cluster 0 up to the end of the backing file name, updating
    /// `backing_file_offset`/`backing_file_size` in the header to where the name lands.
    /// The extensions are written in their current order, then an end marker, then the name.
    /// Fails when the result would not fit in one cluster.
    pub fn encode(&mut self) -> Result<Vec<u8>> {
        let cluster_size = self.header.cluster_size().unwrap_or(0);
        let mut ext = Vec::new();
        for e in &self.extensions {
            let data = e.data();
            let len = u32::try_from(data.len()).map_err(|_| FormatError::Overflow {
                what: "header extension length",
                reason: format!("{} bytes do not fit in 32 bits", data.len()),
            })?;
            ext.extend_from_slice(&e.kind().to_be_bytes());
            ext.extend_from_slice(&len.to_be_bytes());
            ext.extend_from_slice(&data);
            ext.resize(pad8(ext.len()), 0);
        }
        ext.extend_from_slice(&[0u8; 8]);
        let name_at = u64::from(self.header.header_length) + ext.len() as u64;
        match &self.backing_file {
            Some(name) => {
                if name.len() > MAX_BACKING_NAME {
                    return Err(FormatError::InvalidField {
                        what: "backing_file_size",
                        offset: 16,
                        value: name.len() as u64,
                        reason: format!("a backing file name is at most {MAX_BACKING_NAME} bytes"),
                    });
                }
                self.header.backing_file_offset = name_at;
                self.header.backing_file_size = name.len() as u32;
            }
            None => {
                self.header.backing_file_offset = 0;
                self.header.backing_file_size = 0;
            }
        }
        let mut out = self.header.encode()?;
        out.extend_from_slice(&ext);
        if let Some(name) = &self.backing_file {
            out.extend_from_slice(name);
        }
        if out.len() as u64 > cluster_size {
            return Err(FormatError::Overflow {
                what: "cluster 0",
                reason: format!(
                    "header, extensions and backing name take {} bytes, more than the cluster size {cluster_size}",
                    out.len()
                ),
            });
        }
        Ok(out)
    }
}
