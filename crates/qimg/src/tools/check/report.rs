//! The report of a check ([`CheckReport`], `qemu-img check --output=json`'s fields) and the
//! signed counters a pass keeps while it runs (QEMU's `BdrvCheckResult`).

#[cfg(feature = "json")]
use serde::Serialize;

#[cfg(feature = "json")]
fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The result of a check, with `qemu-img check --output=json`'s field names (QAPI
/// `ImageCheck`). Counters that are zero are left out of the JSON, except `check-errors`;
/// the fields are in the order qemu-img prints them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "json", derive(Serialize))]
pub struct CheckReport {
    /// End of the last cluster in use (referenced or with a refcount), in bytes.
    #[cfg_attr(
        feature = "json",
        serde(rename = "image-end-offset", skip_serializing_if = "is_zero")
    )]
    pub image_end_offset: u64,
    /// Compressed clusters among the allocated ones.
    #[cfg_attr(
        feature = "json",
        serde(rename = "compressed-clusters", skip_serializing_if = "is_zero")
    )]
    pub compressed_clusters: u64,
    /// Clusters of the virtual disk.
    #[cfg_attr(
        feature = "json",
        serde(rename = "total-clusters", skip_serializing_if = "is_zero")
    )]
    pub total_clusters: u64,
    /// Corruptions found and not repaired.
    #[cfg_attr(feature = "json", serde(skip_serializing_if = "is_zero"))]
    pub corruptions: u64,
    /// Corruptions repaired.
    #[cfg_attr(
        feature = "json",
        serde(rename = "corruptions-fixed", skip_serializing_if = "is_zero")
    )]
    pub corruptions_fixed: u64,
    /// Internal errors (I/O errors, impossible repairs): the check is not complete.
    #[cfg_attr(feature = "json", serde(rename = "check-errors"))]
    pub check_errors: u64,
    /// Leaked clusters found and not freed.
    #[cfg_attr(feature = "json", serde(skip_serializing_if = "is_zero"))]
    pub leaks: u64,
    /// Leaked clusters freed.
    #[cfg_attr(
        feature = "json",
        serde(rename = "leaks-fixed", skip_serializing_if = "is_zero")
    )]
    pub leaks_fixed: u64,
    /// Guest clusters mapped by the active L1 table (data, preallocated or compressed).
    #[cfg_attr(
        feature = "json",
        serde(rename = "allocated-clusters", skip_serializing_if = "is_zero")
    )]
    pub allocated_clusters: u64,
    /// The image file name as given.
    pub filename: String,
    /// Always `qcow2`.
    pub format: String,
    /// Allocated clusters not contiguous with the previous one of their L2 table (every
    /// compressed cluster counts).
    #[cfg_attr(
        feature = "json",
        serde(rename = "fragmented-clusters", skip_serializing_if = "is_zero")
    )]
    pub fragmented_clusters: u64,
    /// Set when the check could not be completed (qemu-img prints `Check failed: ...` and
    /// nothing else); the counters are then meaningless.
    #[cfg_attr(feature = "json", serde(skip))]
    pub failure: Option<String>,
}

impl CheckReport {
    /// `qemu-img check`'s exit code: 0 clean, 1 check not completed (failure or check
    /// errors), 2 corruptions, 3 leaks only.
    pub fn exit_code(&self) -> u8 {
        if self.failure.is_some() || self.check_errors > 0 {
            1
        } else if self.corruptions > 0 {
            2
        } else if self.leaks > 0 {
            3
        } else {
            0
        }
    }
}

/// QEMU's `BdrvCheckResult` (signed: QEMU counts up and back down).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Counters {
    pub(super) corruptions: i64,
    pub(super) leaks: i64,
    pub(super) check_errors: i64,
    pub(super) corruptions_fixed: i64,
    pub(super) leaks_fixed: i64,
    pub(super) image_end_offset: u64,
    pub(super) total_clusters: u64,
    pub(super) allocated_clusters: u64,
    pub(super) fragmented_clusters: u64,
    pub(super) compressed_clusters: u64,
}

impl Counters {
    pub(super) fn add(&mut self, o: &Counters, allocation_info: bool) {
        self.corruptions += o.corruptions;
        self.leaks += o.leaks;
        self.check_errors += o.check_errors;
        self.corruptions_fixed += o.corruptions_fixed;
        self.leaks_fixed += o.leaks_fixed;
        if allocation_info {
            self.image_end_offset = o.image_end_offset;
            self.total_clusters = o.total_clusters;
            self.allocated_clusters = o.allocated_clusters;
            self.fragmented_clusters = o.fragmented_clusters;
            self.compressed_clusters = o.compressed_clusters;
        }
    }

    pub(super) fn report(&self) -> CheckReport {
        let n = |v: i64| v.max(0) as u64;
        CheckReport {
            image_end_offset: self.image_end_offset,
            compressed_clusters: self.compressed_clusters,
            total_clusters: self.total_clusters,
            corruptions: n(self.corruptions),
            corruptions_fixed: n(self.corruptions_fixed),
            check_errors: n(self.check_errors),
            leaks: n(self.leaks),
            leaks_fixed: n(self.leaks_fixed),
            allocated_clusters: self.allocated_clusters,
            filename: String::new(),
            format: String::new(),
            fragmented_clusters: self.fragmented_clusters,
            failure: None,
        }
    }
}
