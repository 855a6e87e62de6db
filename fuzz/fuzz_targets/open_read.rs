//! Arbitrary bytes as an image in memory: open read-only, map and read (bounded), then open
//! read-write on a copy, write, flush and close.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_testkit::fuzzing::open_read(data);
});
