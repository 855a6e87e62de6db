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
