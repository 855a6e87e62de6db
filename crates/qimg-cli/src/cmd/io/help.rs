//! The long texts of `help COMMAND`, as qemu-io 10 prints them after the usage line
//! (commands without one print only that line).

/// The text `help NAME` prints after the usage line of command `name`, if it has one.
pub(super) fn long_help(name: &str) -> Option<&'static str> {
    Some(match name {
        "aio_read" => {
            r#"
 asynchronously reads a range of bytes from the given offset

 Example:
 'aio_read -v 512 1k 1k ' - dumps 2 kilobytes read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 The read is performed asynchronously and the aio_flush command must be
 used to ensure all outstanding aio requests have been completed.
 Note that due to its asynchronous nature, this command will be
 considered successful once the request is submitted, independently
 of potential I/O errors or pattern mismatches.
 -C, -- report statistics in a machine parsable format
 -i, -- treat request as invalid, for exercising stats
 -P, -- use a pattern to verify read data
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer
 -v, -- dump buffer to standard output

"#
        }
        "aio_write" => {
            r#"
 asynchronously writes a range of bytes from the given offset source
 from multiple buffers

 Example:
 'aio_write 512 1k 1k' - writes 2 kilobytes at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 The write is performed asynchronously and the aio_flush command must be
 used to ensure all outstanding aio requests have been completed.
 Note that due to its asynchronous nature, this command will be
 considered successful once the request is submitted, independently
 of potential I/O errors or pattern mismatches.
 -C, -- report statistics in a machine parsable format
 -f, -- use Force Unit Access semantics
 -i, -- treat request as invalid, for exercising stats
 -P, -- use different pattern to fill file
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer
 -u, -- with -z, allow unmapping
 -z, -- write zeroes using blk_aio_pwrite_zeroes

"#
        }
        "discard" => {
            r#"
 discards a range of bytes from the given offset

 Example:
 'discard 512 1k' - discards 1 kilobyte from 512 bytes into the file

 Discards a segment of the currently open file.
 -C, -- report statistics in a machine parsable format
 -q, -- quiet mode, do not show I/O statistics

"#
        }
        "open" => {
            r#"
 opens a new file in the requested mode

 Example:
 'open -n -o driver=raw /tmp/data' - opens raw data file read-write, uncached

 Opens a file for subsequent use by all of the other qemu-io commands.
 -r, -- open file read-only
 -s, -- use snapshot file
 -C, -- use copy-on-read
 -n, -- disable host cache, short for -t none
 -U, -- force shared permissions
 -k, -- use kernel AIO implementation (Linux only, prefer use of -i)
 -i, -- use AIO mode (threads, native or io_uring)
 -t, -- use the given cache mode for the image
 -d, -- use the given discard mode for the image
 -o, -- options to be given to the block driver
"#
        }
        "read" => {
            r#"
 reads a range of bytes from the given offset

 Example:
 'read -v 512 1k' - dumps 1 kilobyte read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 -b, -- read from the VM state rather than the virtual disk
 -C, -- report statistics in a machine parsable format
 -l, -- length for pattern verification (only with -P)
 -p, -- ignored for backwards compatibility
 -P, -- use a pattern to verify read data
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer
 -s, -- start offset for pattern verification (only with -P)
 -v, -- dump buffer to standard output

"#
        }
        "readv" => {
            r#"
 reads a range of bytes from the given offset into multiple buffers

 Example:
 'readv -v 512 1k 1k ' - dumps 2 kilobytes read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 Uses multiple iovec buffers if more than one byte range is specified.
 -C, -- report statistics in a machine parsable format
 -P, -- use a pattern to verify read data
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer
 -v, -- dump buffer to standard output

"#
        }
        "reopen" => {
            r#"
 Changes the open options of an already opened image

 Example:
 'reopen -o lazy-refcounts=on' - activates lazy refcount writeback on a qcow2 image

 -r, -- Reopen the image read-only
 -w, -- Reopen the image read-write
 -c, -- Change the cache mode to the given value
 -o, -- Changes block driver options (cf. 'open' command)

"#
        }
        "sigraise" => {
            r#"
 raises the given signal

 Example:
 'sigraise 15' - raises SIGTERM

 Invokes raise(signal), where "signal" is the mandatory integer argument
 given to sigraise.

"#
        }
        "write" => {
            r#"
 writes a range of bytes from the given offset

 Example:
 'write 512 1k' - writes 1 kilobyte at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 -b, -- write to the VM state rather than the virtual disk
 -c, -- write compressed data with blk_write_compressed
 -C, -- report statistics in a machine parsable format
 -f, -- use Force Unit Access semantics
 -n, -- with -z, don't allow slow fallback
 -p, -- ignored for backwards compatibility
 -P, -- use different pattern to fill file
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer
 -s, -- use a pattern file to fill the write buffer
 -u, -- with -z, allow unmapping
 -z, -- write zeroes using blk_pwrite_zeroes

"#
        }
        "writev" => {
            r#"
 writes a range of bytes from the given offset source from multiple buffers

 Example:
 'writev 512 1k 1k' - writes 2 kilobytes at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 -C, -- report statistics in a machine parsable format
 -f, -- use Force Unit Access semantics
 -P, -- use different pattern to fill file
 -q, -- quiet mode, do not show I/O statistics
 -r, -- register I/O buffer

"#
        }
        _ => return None,
    })
}

/// What `qemu-io --help` prints, as qemu-io 10 prints it.
pub const USAGE: &str = r#"Usage: qemu-io [OPTIONS]... [-c STRING]... [file]
QEMU Disk exerciser

  --object OBJECTDEF   define an object such as 'secret' for
                       passwords and/or encryption keys
  --image-opts         treat file as option string
  -c, --cmd STRING     execute command with its arguments
                       from the given string
  -f, --format FMT     specifies the block driver to use
  -r, --read-only      export read-only
  -s, --snapshot       use snapshot file
  -n, --nocache        disable host cache, short for -t none
  -C, --copy-on-read   enable copy-on-read
  -m, --misalign       misalign allocations for O_DIRECT
  -k, --native-aio     use kernel AIO implementation
                       (Linux only, prefer use of -i)
  -i, --aio=MODE       use AIO mode (threads, native or io_uring)
  -t, --cache=MODE     use the given cache mode for the image
  -d, --discard=MODE   use the given discard mode for the image
  -T, --trace [[enable=]<pattern>][,events=<file>][,file=<file>]
                       specify tracing options
                       see qemu-img(1) man page for full description
  -U, --force-share    force shared permissions
  -h, --help           display this help and exit
  -V, --version        output version information and exit

See 'qemu-io -c help' for information on available commands.

See <https://qemu.org/contribute/report-a-bug> for how to report bugs.
More information on the QEMU project at <https://qemu.org>.
"#;
