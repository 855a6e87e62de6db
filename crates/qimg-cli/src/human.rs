//! qemu-img's human-readable `info` text.

use qimg::tools::info::ImageInfo;

/// qemu's `size_to_str`: three significant digits, switching unit at 1000.
pub fn size_to_str(v: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut i = 0;
    while i < 6 && (v as f64) >= 1000.0 * (1u64 << (10 * i)) as f64 {
        i += 1;
    }
    let x = v as f64 / (1u64 << (10 * i)) as f64;
    format!("{} {}", g3(x), UNITS[i])
}

/// printf's `%0.3g` for 0 <= x < 1000.
fn g3(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let digits = x.log10().floor() as i32 + 1;
    let decimals = (3 - digits).max(0) as usize;
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `%Y-%m-%d %H:%M:%S` of a Unix time, in UTC (qemu-img prints local time; the two agree
/// when TZ is UTC).
pub fn utc_date(secs: u64) -> String {
    let days = secs / 86400;
    let rem = secs % 86400;
    // Civil-from-days (proleptic Gregorian), days since 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn yes(b: &serde_json::Value) -> String {
    match b {
        serde_json::Value::Bool(b) => b.to_string(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The members of `obj` as QEMU's `dump_qobject` prints format-specific information: in
/// `QDict` order, `-` in keys as spaces, a nested object or list on the lines below its key
/// (list items as `[N]:`), four more spaces for each level.
fn dump_members(obj: &serde_json::Map<String, serde_json::Value>, indent: usize, s: &mut String) {
    for (k, v) in crate::qjson::members(obj) {
        dump_value(&k.replace('-', " "), v, indent, s);
    }
}

fn dump_value(key: &str, v: &serde_json::Value, indent: usize, s: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        serde_json::Value::Object(o) => {
            s.push_str(&format!("{pad}{key}:\n"));
            dump_members(o, indent + 4, s);
        }
        serde_json::Value::Array(items) => {
            s.push_str(&format!("{pad}{key}:\n"));
            for (n, item) in items.iter().enumerate() {
                dump_value(&format!("[{n}]"), item, indent + 4, s);
            }
        }
        other => s.push_str(&format!("{pad}{key}: {}\n", yes(other))),
    }
}

/// `disk size:` as qemu-img prints it (`unavailable` where it cannot be known).
fn disk_size(size: Option<u64>) -> String {
    size.map_or_else(|| "unavailable".to_string(), size_to_str)
}

/// The text `qemu-img info` prints for one image.
pub fn info(i: &ImageInfo) -> String {
    let mut s = String::new();
    s += &format!("image: {}\n", i.filename);
    s += &format!("file format: {}\n", i.format);
    s += &format!(
        "virtual size: {} ({} bytes)\n",
        size_to_str(i.virtual_size),
        i.virtual_size
    );
    s += &format!("disk size: {}\n", disk_size(i.actual_size));
    if i.encrypted == Some(true) {
        s += "encrypted: yes\n";
    }
    if let Some(cs) = i.cluster_size {
        s += &format!("cluster_size: {cs}\n");
    }
    if let Some(b) = &i.backing_filename {
        s += &format!("backing file: {b}");
        if i.full_backing_filename.as_deref() != Some(b.as_str()) {
            if let Some(f) = &i.full_backing_filename {
                s += &format!(" (actual path: {f})");
            }
        }
        s += "\n";
    }
    if let Some(f) = &i.backing_filename_format {
        s += &format!("backing file format: {f}\n");
    }
    if i.dirty_flag == Some(true) {
        s += "cleanly shut down: no\n";
    }
    if let Some(snaps) = &i.snapshots {
        s += "Snapshot list:\n";
        s += &format!(
            "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}\n",
            "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"
        );
        for sn in snaps {
            let secs = sn.vm_clock_sec;
            let clock = format!(
                "{:04}:{:02}:{:02}.{:03}",
                secs / 3600,
                secs / 60 % 60,
                secs % 60,
                sn.vm_clock_nsec / 1_000_000
            );
            s += &format!(
                "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}\n",
                sn.id,
                sn.name,
                size_to_str(sn.vm_state_size),
                utc_date(sn.date_sec),
                clock,
                sn.icount
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "--".into())
            );
        }
    }
    if let Some(fs) = &i.format_specific {
        if let Some(obj) = fs.data.as_object().filter(|o| !o.is_empty()) {
            s += "Format specific information:\n";
            dump_members(obj, 4, &mut s);
        }
    }
    for c in &i.children {
        s += &format!("Child node '/{}':\n", c.name);
        s += &format!("    filename: {}\n", c.info.filename);
        s += &format!("    protocol type: {}\n", c.info.format);
        s += &format!(
            "    file length: {} ({} bytes)\n",
            size_to_str(c.info.virtual_size),
            c.info.virtual_size
        );
        s += &format!("    disk size: {}\n", disk_size(c.info.actual_size));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_print_in_utc() {
        assert_eq!(utc_date(0), "1970-01-01 00:00:00");
        assert_eq!(utc_date(1_795_284_590), "2026-11-21 18:09:50");
        assert_eq!(utc_date(951_782_400), "2000-02-29 00:00:00");
    }

    #[test]
    fn sizes_print_like_qemu() {
        assert_eq!(size_to_str(1 << 30), "1 GiB");
        assert_eq!(size_to_str(397312), "388 KiB");
        assert_eq!(size_to_str(393728), "384 KiB");
        assert_eq!(size_to_str(1000), "0.977 KiB");
        assert_eq!(size_to_str(999), "999 B");
        assert_eq!(size_to_str(0), "0 B");
        assert_eq!(size_to_str(1_572_864), "1.5 MiB");
    }
}
