//! Arbitrary bytes as an image file: check, check -r all, check again.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = qimg_testkit::fuzzing::check(data);
});
