//! Guest bytes as a virtio-blk request: a descriptor chain and guest memory through the
//! vhost-user-blk backend's request parser (see `qimg_serve::fuzzing::vhost_request`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    qimg_serve::fuzzing::vhost_request(data);
});
