//! Cluster compression as QEMU does it: zlib as a raw deflate stream with a 4 KiB window, and
//! zstd frames (compression type 1).
//!
//! Each codec is a cargo feature (`zlib`, `zstd`, both on by default). Without a codec, its
//! compressed clusters cannot be read (an error names the missing feature) and compressed
//! writes store their clusters uncompressed, as QEMU does for data that does not shrink.
//!
//! Decompression must produce exactly one cluster; extra input (the rest of the last sector,
//! or the next compressed cluster sharing it) is ignored, and input that ends before a whole
//! cluster came out is an error.

#[cfg(feature = "zlib")]
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use qimg_format::header::CompressionType;
#[cfg(feature = "zstd")]
use zstd::stream::raw::{InBuffer, Operation, OutBuffer};

/// Why a compressed cluster could not be inflated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecompressError {
    /// The codec's message, or how much output was missing.
    pub reason: String,
}

impl std::fmt::Display for DecompressError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for DecompressError {}

fn fail(reason: impl Into<String>) -> DecompressError {
    DecompressError {
        reason: reason.into(),
    }
}

/// Inflates `input` into all of `out` (one cluster).
pub fn decompress(
    kind: CompressionType,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), DecompressError> {
    let _ = (input, &out);
    match kind {
        #[cfg(feature = "zlib")]
        CompressionType::Zlib => inflate(input, out),
        #[cfg(feature = "zstd")]
        CompressionType::Zstd => unzstd(input, out),
        #[allow(unreachable_patterns)]
        other => Err(fail(format!(
            "{} compressed clusters cannot be read: qimg was built without its codec \
             (cargo feature `{}`)",
            codec_name(other),
            codec_name(other)
        ))),
    }
}

/// The codec's name, which is also the name of its cargo feature.
fn codec_name(kind: CompressionType) -> &'static str {
    match kind {
        CompressionType::Zlib => "zlib",
        CompressionType::Zstd => "zstd",
    }
}

#[cfg(feature = "zlib")]
fn inflate(input: &[u8], out: &mut [u8]) -> Result<(), DecompressError> {
    // A decoder with the largest window accepts every stream a 4 KiB-window encoder makes.
    let mut d = Decompress::new(false);
    let status = d
        .decompress(input, out, FlushDecompress::Finish)
        .map_err(|e| fail(format!("zlib: {e}")))?;
    let produced = d.total_out();
    if produced == out.len() as u64 {
        if status != Status::StreamEnd {
            // The stream did not end with the cluster: see whether it has more to give.
            let rest = &input[d.total_in() as usize..];
            let mut spill = [0u8; 64];
            let _ = d.decompress(rest, &mut spill, FlushDecompress::Finish);
            if d.total_out() > produced {
                return Err(fail(format!(
                    "zlib stream inflates beyond the cluster size of {} bytes",
                    out.len()
                )));
            }
        }
        return Ok(());
    }
    match status {
        Status::StreamEnd => Err(fail(format!(
            "zlib stream ended after {produced} of {} bytes",
            out.len()
        ))),
        _ => Err(fail(format!(
            "zlib input ran out after {produced} of {} bytes",
            out.len()
        ))),
    }
}

#[cfg(feature = "zstd")]
fn unzstd(input: &[u8], out: &mut [u8]) -> Result<(), DecompressError> {
    let mut dec = zstd::stream::raw::Decoder::new().map_err(|e| fail(format!("zstd: {e}")))?;
    let want = out.len();
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(out);
    loop {
        let (in_before, out_before) = (inb.pos(), outb.pos());
        let hint = dec
            .run(&mut inb, &mut outb)
            .map_err(|e| fail(format!("zstd: {e}")))?;
        if outb.pos() == want {
            if hint == 0 {
                // The frame is complete; what follows belongs to the next cluster (QEMU packs
                // compressed clusters into shared sectors).
                return Ok(());
            }
            // More output from the same frame means the data is larger than a cluster.
            let mut spill = [0u8; 64];
            let mut sb = OutBuffer::around(&mut spill[..]);
            let _ = dec.run(&mut inb, &mut sb);
            if sb.pos() > 0 {
                return Err(fail(format!(
                    "zstd frame inflates beyond the cluster size of {want} bytes"
                )));
            }
            return Ok(());
        }
        if inb.pos() == in_before && outb.pos() == out_before {
            return Err(fail(format!(
                "zstd input ran out after {} of {want} bytes",
                outb.pos()
            )));
        }
    }
}

/// Compresses one cluster; `None` when the result would not be smaller than `limit` bytes
/// (QEMU stores such clusters uncompressed).
pub fn compress(kind: CompressionType, input: &[u8], limit: usize) -> Option<Vec<u8>> {
    let out = compress_with(kind, input, limit)?;
    (out.len() < limit).then_some(out)
}

/// The codec's output; `None` without the codec (the cluster is then stored as it is).
fn compress_with(kind: CompressionType, input: &[u8], limit: usize) -> Option<Vec<u8>> {
    let _ = (input, limit);
    match kind {
        #[cfg(feature = "zlib")]
        CompressionType::Zlib => deflate(input, limit),
        #[cfg(feature = "zstd")]
        CompressionType::Zstd => zstd::bulk::compress(input, 0).ok(),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(feature = "zlib")]
fn deflate(input: &[u8], limit: usize) -> Option<Vec<u8>> {
    let mut c = Compress::new_with_window_bits(Compression::default(), false, 12);
    let mut out = vec![0u8; limit];
    match c.compress(input, &mut out, FlushCompress::Finish).ok()? {
        Status::StreamEnd => {
            out.truncate(usize::try_from(c.total_out()).ok()?);
            Some(out)
        }
        _ => None,
    }
}

#[cfg(all(test, feature = "zlib", feature = "zstd"))]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7) % 251) as u8 / 3).collect()
    }

    #[test]
    fn both_codecs_round_trip_a_cluster_with_trailing_garbage() {
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let data = sample(65536);
            let mut packed = compress(kind, &data, 65535).expect("compressible");
            packed.extend_from_slice(&[0xAB; 700]);
            let mut out = vec![0u8; 65536];
            decompress(kind, &packed, &mut out).unwrap();
            assert_eq!(out, data, "{kind:?}");
        }
    }

    #[test]
    fn truncated_input_is_an_error_naming_how_much_came_out() {
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let data = sample(16384);
            let packed = compress(kind, &data, 16383).unwrap();
            let mut out = vec![0u8; 16384];
            let err = decompress(kind, &packed[..packed.len() / 2], &mut out).unwrap_err();
            assert!(
                err.reason.contains("of 16384") || err.reason.contains(':'),
                "{kind:?}: {err}"
            );
        }
    }

    #[test]
    fn incompressible_data_is_refused() {
        let mut x = 0x1234_5678u32;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        assert!(compress(CompressionType::Zlib, &noise, 4095).is_none());
        assert!(compress(CompressionType::Zstd, &noise, 4095).is_none());
    }

    #[test]
    fn data_larger_than_a_cluster_is_an_error() {
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let big = sample(8192);
            let packed = compress(kind, &big, 8192).unwrap();
            let mut out = vec![0u8; 4096];
            let e = decompress(kind, &packed, &mut out).unwrap_err();
            assert!(
                e.to_string().contains("beyond the cluster size"),
                "{kind:?}: {e}"
            );
            // Exactly one cluster still works.
            let mut out = vec![0u8; 8192];
            decompress(kind, &packed, &mut out).unwrap();
            assert_eq!(out, big);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut out = vec![0u8; 4096];
        assert!(decompress(CompressionType::Zlib, &[0xff; 64], &mut out).is_err());
        assert!(decompress(CompressionType::Zstd, &[0xff; 64], &mut out).is_err());
        assert!(decompress(CompressionType::Zstd, &[], &mut out).is_err());
    }
}
