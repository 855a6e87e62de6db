//! Sequences of writes, write-zeroes, discards, reads, flushes and reopens on a valid image
//! (shape from the first two bytes) against a flat model; the library check at the end.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_testkit::fuzzing::ops(data);
});
