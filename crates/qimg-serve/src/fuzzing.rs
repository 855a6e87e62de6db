//! The harness of the `nbd` fuzz target, here so that `cargo test` runs it too: bytes from
//! a client go through the whole server (handshake and transmission) in memory, on a small
//! qcow2 image in a [`MemStorage`]. Whatever the bytes, the server must end without panicking
//! and without allocating beyond its limits.

use std::sync::{Arc, OnceLock};

use qimg::OpenOptions;
use qimg::io::MemStorage;
use qimg::tools::create::{CreateOptions, create};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::nbd::{Export, Shutdown, serve_connection};

/// A new 1 MiB qcow2 image (standard or extended L2), made once per process.
fn template(extended_l2: bool) -> &'static [u8] {
    static T: [OnceLock<Vec<u8>>; 2] = [OnceLock::new(), OnceLock::new()];
    T[usize::from(extended_l2)].get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("qimg-serve-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        let path = dir.join(format!("t{}.qcow2", u8::from(extended_l2)));
        let opts = CreateOptions {
            size: Some(1 << 20),
            extended_l2,
            ..CreateOptions::default()
        };
        create(&path, &opts, &mut |_, _| {}).expect("create the template image");
        let bytes = std::fs::read(&path).expect("read the template image");
        let _ = std::fs::remove_dir_all(&dir);
        bytes
    })
}

/// Runs one connection: `data[0]` picks the export (bit 0 extended L2, bit 1 read-only,
/// bit 2 allocation depth), the rest is what the client sends.
pub fn connection(data: &[u8]) {
    let Some((&shape, input)) = data.split_first() else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let file = MemStorage::from_bytes(template(shape & 1 != 0));
        let img = OpenOptions::new()
            .writable(true)
            .clean_timer(false)
            .open_storage(file, "fuzz.qcow2", None, None)
            .await
            .expect("open the template image");
        let mut export = Export::new(img);
        export.read_only = shape & 2 != 0;
        export.allocation_depth = shape & 4 != 0;
        let export = Arc::new(export);
        let (client, server) = tokio::io::duplex(64 << 10);
        let (mut rd, mut wr) = tokio::io::split(client);
        let input = input.to_vec();
        // The client: send everything, then close; read (and drop) every reply.
        let send = tokio::spawn(async move {
            let _ = wr.write_all(&input).await;
            let _ = wr.shutdown().await;
        });
        let drain = tokio::spawn(async move {
            let mut sink = vec![0u8; 64 << 10];
            while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        let _ = serve_connection(Box::new(server), export.clone(), Shutdown::never()).await;
        let _ = send.await;
        let _ = drain.await;
        let _ = export.image.close().await;
    });
}

/// The harness of the `vhost_request` fuzz target: a virtio-blk descriptor chain and guest
/// memory made from the bytes go through [`crate::vhost_user_blk::request::parse`] and, for
/// requests that carry data, through [`qimg::IoBuffers::from_guest`], as the backend does.
/// Whatever the bytes: no panic, and every accepted request lies within the disk, aligned,
/// with its status byte inside the chain's last descriptor.
///
/// Layout: byte 0 picks read-only (bit 0) and a 4096-byte block size (bit 1); byte 1 is the
/// number of descriptors (up to 16); then 9 bytes per descriptor (address: 4 bytes LE, length:
/// 4 bytes LE, flags: bit 0 device-writable); the rest fills the 64 KiB of guest memory from
/// address 0 (addresses beyond it are outside guest memory).
#[cfg(target_os = "linux")]
pub fn vhost_request(data: &[u8]) {
    use crate::vhost_user_blk::request::{BlkRequest, Desc, Limits, parse};
    use std::sync::Arc;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    const MEM: usize = 64 << 10;
    let (Some(&flags), Some(&count)) = (data.first(), data.get(1)) else {
        return;
    };
    let count = usize::from(count % 17);
    let mut at = 2;
    let mut descs = Vec::with_capacity(count);
    for _ in 0..count {
        let Some(d) = data.get(at..at + 9) else {
            return;
        };
        at += 9;
        descs.push(Desc {
            addr: u64::from(u32::from_le_bytes([d[0], d[1], d[2], d[3]])),
            len: u32::from_le_bytes([d[4], d[5], d[6], d[7]]),
            write_only: d[8] & 1 != 0,
        });
    }
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]) else {
        return;
    };
    let fill = &data[at.min(data.len())..];
    let _ = mem.write_slice(&fill[..fill.len().min(MEM)], GuestAddress(0));
    let limits = Limits {
        capacity: 8 << 20,
        block_size: if flags & 2 != 0 { 4096 } else { 512 },
        read_only: flags & 1 != 0,
        max_segments: 126,
        max_bytes: 32 << 20,
        max_zero_sectors: 1 << 21,
        max_zero_segments: 1,
    };
    let parsed = parse(&mem, &descs, &limits);
    if let Some(status) = parsed.status {
        let last = descs.last().expect("a status needs a descriptor");
        assert!(last.write_only && status >= last.addr && status < last.addr + u64::from(last.len));
    } else {
        assert!(
            parsed.request.is_err(),
            "a request accepted without a status byte"
        );
    }
    let Ok(request) = parsed.request else {
        return;
    };
    let within = |offset: u64, len: u64, align: u64| {
        assert!(
            offset % align == 0 && len % align == 0,
            "unaligned {offset:#x}+{len:#x}"
        );
        assert!(
            offset + len <= limits.capacity,
            "past the disk: {offset:#x}+{len:#x}"
        );
    };
    let bs = u64::from(limits.block_size);
    let mem = Arc::new(mem);
    match request {
        BlkRequest::Read { offset, data } | BlkRequest::Write { offset, data } => {
            let len: u64 = data.iter().map(|&(_, n)| n as u64).sum();
            within(offset, len, bs);
            assert!(len > 0 && len <= limits.max_bytes);
            if let Ok(b) = qimg::IoBuffers::from_guest(mem, &data) {
                assert_eq!(b.len() as u64, len);
            }
        }
        BlkRequest::Discard { ranges } | BlkRequest::WriteZeroes { ranges, .. } => {
            assert!(!limits.read_only);
            for (offset, len) in ranges {
                within(offset, len, 512);
            }
        }
        BlkRequest::GetId { data } => {
            assert!(data.iter().map(|&(_, n)| n).sum::<usize>() <= 20);
        }
        BlkRequest::Flush => {}
    }
}
