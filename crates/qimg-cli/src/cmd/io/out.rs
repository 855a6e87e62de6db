//! qemu-io's output formats: sizes with binary units, elapsed times, the two report lines of
//! a request (or its `-C` CSV line) and the `-v` hex dump.

use std::fmt::Write as _;
use std::time::Duration;

/// A size as qemu-io prints it: three decimals in the largest binary unit it reaches (KiB
/// up to EiB), or bytes with six decimals; a fraction of `.000` is dropped.
pub fn size_str(value: f64) -> String {
    const UNITS: [(&str, f64); 6] = [
        (" EiB", (1u64 << 60) as f64),
        (" PiB", (1u64 << 50) as f64),
        (" TiB", (1u64 << 40) as f64),
        (" GiB", (1u64 << 30) as f64),
        (" MiB", (1u64 << 20) as f64),
        (" KiB", (1u64 << 10) as f64),
    ];
    let (mut s, suffix) = match UNITS.iter().find(|(_, u)| value >= *u) {
        Some((suffix, unit)) => (format!("{:.3}", value / unit), *suffix),
        None => (format!("{value:.6}"), " bytes"),
    };
    if let Some(i) = s.find(".000") {
        s.truncate(i);
    }
    s.push_str(suffix);
    s
}

/// An elapsed time: `SS.ss sec` under a second's whole count of zero, else `H:MM:SS.ss`
/// (always the latter with `fixed`, the `-C` format).
pub fn time_str(t: Duration, fixed: bool) -> String {
    let secs = t.as_secs();
    let frac = f64::from(t.subsec_nanos()) / 1e9;
    if fixed || secs > 0 {
        format!(
            "{}:{:02}:{:05.2}",
            secs / 3600,
            secs / 60 % 60,
            (secs % 60) as f64 + frac
        )
    } else {
        format!("{frac:05.2} sec")
    }
}

/// `value` per second of `t`.
fn per_sec(value: f64, t: Duration) -> f64 {
    value / t.as_secs_f64()
}

/// The report of a request: `OP TOTAL/COUNT bytes at offset OFF` and the rate line, or with
/// `csv` one line `bytes,ops,time,bytes/sec,ops/sec`.
pub fn report(op: &str, t: Duration, offset: u64, count: u64, total: u64, csv: bool) -> String {
    let ops = 1u32;
    if csv {
        return format!(
            "{total},{ops},{},{:.3},{:.3}\n",
            time_str(t, true),
            per_sec(total as f64, t),
            per_sec(f64::from(ops), t)
        );
    }
    format!(
        "{op} {total}/{count} bytes at offset {offset}\n{}, {ops} ops; {} ({}/sec and {:.4} ops/sec)\n",
        size_str(total as f64),
        time_str(t, false),
        size_str(per_sec(total as f64, t)),
        per_sec(f64::from(ops), t)
    )
}

/// The `-v` dump: 16 bytes a line, the guest offset in hex, the bytes, and the letters and
/// digits among them (anything else as `.`).
pub fn hex_dump(buf: &[u8], offset: u64) -> String {
    let mut s = String::new();
    for (i, line) in buf.chunks(16).enumerate() {
        let _ = write!(s, "{:08x}:  ", offset + 16 * i as u64);
        for b in line {
            let _ = write!(s, "{b:02x} ");
        }
        s.push(' ');
        for &b in line {
            s.push(if b.is_ascii_alphanumeric() {
                b as char
            } else {
                '.'
            });
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_as_qemu_io_prints_them() {
        assert_eq!(size_str(65536.0), "64 KiB");
        assert_eq!(size_str(12800.0), "12.500 KiB");
        assert_eq!(size_str(40.0), "40 bytes");
        assert_eq!(size_str(0.0), "0 bytes");
        assert_eq!(size_str(0.449556), "0.449556 bytes");
        assert_eq!(size_str(4_128_768.0), "3.938 MiB");
        assert_eq!(size_str((512u64 << 30) as f64), "512 GiB");
    }

    #[test]
    fn times() {
        assert_eq!(time_str(Duration::from_millis(10), false), "00.01 sec");
        assert_eq!(time_str(Duration::from_millis(10), true), "0:00:00.01");
        assert_eq!(time_str(Duration::from_secs(3723), false), "1:02:03.00");
    }

    #[test]
    fn dump_lines() {
        let d = hex_dump(&[0x41; 20], 0);
        assert_eq!(
            d,
            "00000000:  41 41 41 41 41 41 41 41 41 41 41 41 41 41 41 41  AAAAAAAAAAAAAAAA\n\
             00000010:  41 41 41 41  AAAA\n"
        );
        assert_eq!(hex_dump(&[0, 0xff], 17), "00000011:  00 ff  ..\n");
    }

    #[test]
    fn report_lines() {
        let r = report("wrote", Duration::from_millis(10), 0, 4096, 4096, false);
        assert_eq!(
            r,
            "wrote 4096/4096 bytes at offset 0\n\
             4 KiB, 1 ops; 00.01 sec (400 KiB/sec and 100.0000 ops/sec)\n"
        );
    }
}
