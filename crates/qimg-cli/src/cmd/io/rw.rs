//! qemu-io's data commands: `read`, `readv`, `write`, `writev` (and the request bodies of
//! `aio_read`/`aio_write`).

use std::time::Instant;

use super::errors::{Failed, Outcome};
use super::out::hex_dump;
use super::parse::{MAX_REQUEST, Opts};
use super::session::Session;
use super::table::{io_failed, num, offset_and_count, options, pattern, print_report, usage};

/// `read [-Cqv] [-P pattern [-s off] [-l len]] off len`.
pub(super) async fn read(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("read", args, "bCl:pP:qrs:v")?;
    let pat = pattern(&o)?;
    let s_off = o.arg('s').map(num).transpose()?;
    let l_len = o.arg('l').map(num).transpose()?;
    if o.operands.len() != 2 {
        return usage("read");
    }
    if pat.is_none() && (s_off.is_some() || l_len.is_some()) {
        return usage("read");
    }
    let (offset, count) = offset_and_count(&o, "", false)?;
    let p_off = s_off.unwrap_or(0);
    let p_len = l_len.unwrap_or(count.saturating_sub(p_off));
    if p_off.saturating_add(p_len) > count {
        outln!("pattern verification range exceeds end of read data");
        return Err(Failed);
    }
    let vm_state = o.has('b');
    if vm_state {
        sector_aligned(offset, count)?;
    } else {
        s.check_request(offset, count)
            .map_err(|e| io_failed("read", e))?;
    }
    // Filled as qemu-io's buffers are (`qemu_io_alloc`): what a read leaves alone (QEMU's
    // null device) shows as 0xab.
    let mut buf = vec![0xabu8; count as usize];
    let t0 = Instant::now();
    if vm_state {
        s.read_vmstate(&mut buf, offset).await
    } else {
        s.read(&mut buf, offset).await
    }
    .map_err(|e| io_failed("read", e))?;
    let mut outcome = Ok(());
    if let Some(p) = pat {
        let range = &buf[p_off as usize..(p_off + p_len) as usize];
        if range.iter().any(|&b| b != p) {
            outln!(
                "Pattern verification failed at offset {}, {p_len} bytes",
                offset + p_off
            );
            outcome = Err(Failed);
        }
    }
    if o.has('q') {
        return outcome;
    }
    if o.has('v') {
        out!("{}", hex_dump(&buf, offset));
    }
    print_report(&o, "read", t0, offset, count);
    outcome
}

/// The offset and lengths of `readv`/`writev`/`aio_*` operands.
fn vector_operands(o: &Opts) -> Result<(u64, Vec<u64>), Failed> {
    let offset = num(&o.operands[0])?;
    let mut lens = Vec::new();
    for a in &o.operands[1..] {
        let n = num(a)?;
        if n > MAX_REQUEST {
            outln!("Argument '{a}' exceeds maximum size {MAX_REQUEST}");
            return Err(Failed);
        }
        lens.push(n);
    }
    let total: u64 = lens.iter().sum();
    if total > MAX_REQUEST {
        outln!("The total number of bytes exceeds the maximum size {MAX_REQUEST}");
        return Err(Failed);
    }
    Ok((offset, lens))
}

/// `-i` of `aio_read`/`aio_write`: qemu-io counts an invalid request and stops there.
fn invalid_request(o: &Opts, what: &str) -> bool {
    if o.has('i') {
        outln!("injecting invalid {what} request");
    }
    o.has('i')
}

/// `readv` and `aio_read` (`aio`: failures are reported but do not fail the command).
pub(super) async fn readv(s: &mut Session, name: &str, args: &[String], aio: bool) -> Outcome {
    let spec = if aio { "CiP:qrv" } else { "CP:qrv" };
    let o = options(name, args, spec)?;
    if invalid_request(&o, "read") {
        return Ok(());
    }
    let pat = pattern(&o)?;
    if o.operands.len() < 2 {
        return usage(name);
    }
    let (offset, lens) = vector_operands(&o)?;
    let total: u64 = lens.iter().sum();
    // The aio path answers with the message of qemu-io's vectored read.
    let failed = |e| {
        let f = io_failed("readv", e);
        if aio { Ok(()) } else { Err(f) }
    };
    if let Err(e) = s.check_request(offset, total) {
        return failed(e);
    }
    let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0xabu8; n as usize]).collect();
    let t0 = Instant::now();
    if let Err(e) = s.read_vectored(&mut bufs, offset).await {
        return failed(e);
    }
    let data = bufs.concat();
    let mut outcome = Ok(());
    if let Some(p) = pat {
        if data.iter().any(|&b| b != p) {
            outln!("Pattern verification failed at offset {offset}, {total} bytes");
            if !aio {
                outcome = Err(Failed);
            }
        }
    }
    if o.has('q') {
        return outcome;
    }
    if o.has('v') {
        out!("{}", hex_dump(&data, offset));
    }
    print_report(&o, "read", t0, offset, total);
    outcome
}

/// `write [-cCfnquz] [-P pattern] off len`.
pub(super) async fn write(s: &mut Session, args: &[String]) -> Outcome {
    let o = options("write", args, "bcCfnpP:qrs:uz")?;
    let pat = pattern(&o)?;
    if o.operands.len() != 2 {
        return usage("write");
    }
    let z = o.has('z');
    if o.has('b') && z {
        outln!("-b and -z cannot be specified at the same time");
        return Err(Failed);
    }
    if o.has('f') && o.has('b') {
        outln!("-f and -b cannot be specified at the same time");
        return Err(Failed);
    }
    if o.has('u') && !z {
        outln!("-u requires -z to be specified");
        return Err(Failed);
    }
    if o.has('n') && !z {
        outln!("-n requires -z to be specified");
        return Err(Failed);
    }
    if usize::from(z) + usize::from(pat.is_some()) + usize::from(o.has('s')) > 1 {
        outln!("Only one of -z, -P, and -s can be specified at the same time");
        return Err(Failed);
    }
    let (offset, count) = offset_and_count(&o, " without -n", z && o.has('n'))?;
    let fua = o.has('f');
    let vm_state = o.has('b');
    if vm_state {
        sector_aligned(offset, count)?;
    } else {
        s.check_request(offset, count)
            .map_err(|e| io_failed("write", e))?;
    }
    let t0 = Instant::now();
    // -b and -z never come together (refused above).
    let r = if z {
        s.write_zeroes(offset, count, o.has('u'), fua).await
    } else {
        let buf = match o.arg('s') {
            Some(file) => pattern_file(file, count)?,
            None => vec![pat.unwrap_or(0xcd); count as usize],
        };
        if vm_state {
            s.write_vmstate(&buf, offset).await
        } else if o.has('c') {
            s.write_compressed(&buf, offset, fua).await
        } else {
            s.write(&buf, offset, fua).await
        }
    };
    r.map_err(|e| io_failed("write", e))?;
    print_report(&o, "wrote", t0, offset, count);
    Ok(())
}

/// The VM-state area is read and written in 512-byte sectors, as qemu-io's `-b` requires.
fn sector_aligned(offset: u64, count: u64) -> Result<(), Failed> {
    for (value, name) in [(offset, "offset"), (count, "count")] {
        if value % 512 != 0 {
            outln!("{value} is not a sector-aligned value for '{name}'");
            return Err(Failed);
        }
    }
    Ok(())
}

/// `write -s FILE`: `count` bytes of the file's first `count` bytes, repeated.
fn pattern_file(file: &str, count: u64) -> Result<Vec<u8>, Failed> {
    use std::io::Read;
    let mut head = Vec::new();
    let read = std::fs::File::open(file).and_then(|f| f.take(count).read_to_end(&mut head));
    if let Err(e) = read {
        complain!("{file}: {}", crate::status::os_msg(&e));
        return Err(Failed);
    }
    if head.is_empty() {
        complain!("{file}: file is empty");
        return Err(Failed);
    }
    Ok(head.iter().copied().cycle().take(count as usize).collect())
}

/// `writev` and `aio_write` (`aio`: failures are reported but do not fail the command).
pub(super) async fn writev(s: &mut Session, name: &str, args: &[String], aio: bool) -> Outcome {
    let spec = if aio { "CfiP:qruz" } else { "CfP:qr" };
    let o = options(name, args, spec)?;
    if invalid_request(&o, "write") {
        return Ok(());
    }
    let pat = pattern(&o)?;
    if o.operands.len() < 2 {
        return usage(name);
    }
    let z = o.has('z');
    if o.has('u') && !z {
        outln!("-u requires -z to be specified");
        return Err(Failed);
    }
    if z && o.operands.len() != 2 {
        outln!("-z supports only a single length parameter");
        return Err(Failed);
    }
    let (offset, lens) = vector_operands(&o)?;
    let total: u64 = lens.iter().sum();
    let fua = o.has('f');
    if let Err(e) = s.check_request(offset, total) {
        let f = io_failed(name, e);
        return if aio { Ok(()) } else { Err(f) };
    }
    let t0 = Instant::now();
    let r = if z {
        s.write_zeroes(offset, total, o.has('u'), fua).await
    } else {
        let bufs: Vec<Vec<u8>> = lens
            .iter()
            .map(|&n| vec![pat.unwrap_or(0xcd); n as usize])
            .collect();
        s.write_vectored(&bufs, offset, fua).await
    };
    if let Err(e) = r {
        let f = io_failed(name, e);
        return if aio { Ok(()) } else { Err(f) };
    }
    print_report(&o, "wrote", t0, offset, total);
    Ok(())
}
