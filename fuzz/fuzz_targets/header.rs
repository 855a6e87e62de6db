//! Header, header extensions and backing name decoding, with open-time validation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_testkit::fuzzing::format::header_and_extensions(data);
});
