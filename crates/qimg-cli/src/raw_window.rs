//! QEMU's raw format with `offset` and `size` (a part of a file as the image): the options
//! checked in QEMU's words and order, then the file opened as a window
//! ([`qimg::io::window`]) by every later open of it.

use qimg::io::WindowOptions;

/// A size option of an option string (`key`: its name) as QEMU's option parser reads it.
fn size_option(key: &str, v: &str) -> Result<u64, String> {
    if v.trim_start().starts_with('-') {
        return Err(format!("Value '{v}' is out of range for parameter '{key}'"));
    }
    crate::args::parse_size(v).ok_or_else(|| {
        format!(
            "Parameter '{key}' expects a non-negative number below 2^64\nOptional suffix k, M, \
             G, T, P or E means kilo-, mega-, giga-, tera-, peta-\nand exabytes, respectively."
        )
    })
}

/// Applies raw's `offset` and `size` (as given, if at all) to the file `name`: checked
/// against the file as QEMU's raw driver checks them (`raw_apply_options`), then attached so
/// that every later open of `name` is that window.
pub fn apply(name: &str, offset: Option<&String>, size: Option<&String>) -> Result<(), String> {
    if offset.is_none() && size.is_none() {
        return Ok(());
    }
    let offset = offset.map(|v| size_option("offset", v)).transpose()?;
    let size = size.map(|v| size_option("size", v)).transpose()?;
    // A file that is not there is left for the open to report.
    let Ok(real) = std::fs::metadata(name).map(|m| m.len()) else {
        return Ok(());
    };
    let at = offset.unwrap_or(0);
    if at > real {
        return Err(format!(
            "Offset ({at}) cannot be greater than size of the containing file ({real})"
        ));
    }
    if let Some(size) = size {
        if real - at < size {
            return Err(format!(
                "The sum of offset ({at}) and size ({size}) has to be smaller or equal to the  \
                 actual size of the containing file ({real})"
            ));
        }
        if size % 512 != 0 {
            return Err("Specified size is not multiple of 512".into());
        }
    }
    qimg::io::window::attach(name, WindowOptions { offset: at, size });
    Ok(())
}

/// The window `name` is opened as, if any.
pub fn window(name: &str) -> Option<WindowOptions> {
    qimg::io::window::attached(std::path::Path::new(name))
}
