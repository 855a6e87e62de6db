//! L2 table slices, standard and extended (the first byte chooses the geometry): every entry,
//! every accessor, re-encoding.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_testkit::fuzzing::format::l2_slice(data);
});
