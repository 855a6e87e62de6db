//! Bytes from an NBD client through the whole server (handshake and transmission) in
//! memory, on a small qcow2 image; the first byte picks the export's shape.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_serve::fuzzing::connection(data);
});
