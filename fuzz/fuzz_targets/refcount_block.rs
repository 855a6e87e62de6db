//! Refcount blocks of every width (the first byte chooses the order) and refcount tables:
//! decoding, get/set round trips, re-encoding.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_testkit::fuzzing::format::refcount_block(data);
});
